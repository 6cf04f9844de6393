#!/bin/bash
# The before/after measurements of docs/benchmarks.md ("Exact in every precision"), in one run.
# BEFORE: a worktree of the code before the change (git worktree add /tmp/before 0c50a08);
# /tmp/s135: python -m specdec.commands.tiny /tmp/s135 --layers 30 --hidden 576 --heads 9 --kv-heads 3 \
#            --intermediate 1536 --vocab 49152 --tie
# Run from the repository root with the virtual environment active.
BEFORE=${BEFORE:-/tmp/before}
Z=src/specdec/zoo/data/target
D=src/specdec/zoo/data/draft
B="python -m specdec.commands.cli"
echo "== cost curves, 1 thread"
for d in float32 bfloat16; do
  python docs/measurements/curve.py $Z $d 1 15
  PYTHONPATH=$BEFORE/src python docs/measurements/curve.py $Z $d 1 15
done
for d in float32 bfloat16; do python docs/measurements/curve.py /tmp/s135/target $d 1 3; done
PYTHONPATH=$BEFORE/src python docs/measurements/curve.py /tmp/s135/target float32 1 3
PYTHONPATH=$BEFORE/src python docs/measurements/curve.py /tmp/s135/target bfloat16 1 1
echo "== 135M cost curves, 2 threads"
for d in float32 bfloat16; do python docs/measurements/curve.py /tmp/s135/target $d 2 3; done
PYTHONPATH=$BEFORE/src python docs/measurements/curve.py /tmp/s135/target float32 2 3
for d in float32 bfloat16; do
  for w in after before; do
    P=""; B="python -m specdec.commands.cli"
    [ $w = before ] && P="PYTHONPATH=$BEFORE/src" && B="python -m specdec.cli"  # the layout before the commands/ folder
    echo "== zoo bench $d ($w)"
    env $P $B bench --threads 1 --target $Z --draft $D --tasks code-completion --num-prompts 10 --max-new-tokens 64 -k 4 --backend native --dtype $d --output docs/measurements/bench-zoo-$d-$w.json 2>/dev/null
    echo "== 135M bench $d ($w)"
    env $P $B bench --threads 1 --target /tmp/s135/target --tasks code-completion --num-prompts 3 --max-new-tokens 32 -k 4 --backend native --dtype $d --no-transformers --output docs/measurements/bench-135-$d-$w.json 2>/dev/null
  done
done
echo done
