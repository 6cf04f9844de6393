#!/bin/bash
# The same bench with the session's first kernels (14b7eff's source tree) and with HEAD's, alternating.
# first: git worktree add /tmp/wt14 14b7eff (the session's first source tree)
cd /work/main; . .venv/bin/activate
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then export PYTHONPATH=/tmp/wt14/src; else unset PYTHONPATH; fi
    python -c "import specdec, sys; print('$side', specdec.__file__)"
    specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 16 --max-new-tokens 128 \
      -k 2 --drafters eagle3=/work/main/runs/s11/eagle3/out eagle --no-transformers --threads 2 \
      --output runs/s11/attrib-$side-$round.json 2>/dev/null | grep -E "^specdec"
  done
done
