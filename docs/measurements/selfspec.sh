#!/bin/bash
# The measurements of docs/benchmarks.md "Self-speculation on the zoo target" (issue 14): LayerSkip
# early exit and MTP modules / heads, each variant beside its own plain decoding, in the same runs
# as the draft model and the EAGLE family on the original target.
# Run from the repository root with the virtual environment active, on an otherwise idle machine.
set -e
Z=src/specdec/zoo/data
OUT=docs/measurements
COMMON="--threads 1 --target $Z/target --draft $Z/draft --num-prompts 20 --max-new-tokens 128 --backend native"
SELF="early-exit=$Z/layerskip mtp=$Z/mtp mtp=$Z/mtp-parallel"

echo "== choosing the default exit layer: every exit, k = 4, code-completion (the zoo's recorded default)"
specdec bench --threads 1 --target $Z/target --tasks code-completion --num-prompts 20 --max-new-tokens 128 \
  --backend native -k 4 --drafters early-exit=$Z/layerskip --exit-layers 1 2 3 4 5 6 7 --no-transformers \
  --output $OUT/selfspec-exit-layers.json
echo "== code-completion: draft model, EAGLE-1/3, LayerSkip at exits 2/4/6/7 (+ recompute), MTP depths 1/2/3, transformers' own"
specdec bench $COMMON --tasks code-completion -k 4 --drafters eagle eagle3 $SELF --exit-layers 2 4 6 7 \
  --mtp-depths 1 2 3 --output $OUT/selfspec-code-completion.json
for task in copy-edit long-context; do
  echo "== $task"
  specdec bench $COMMON --tasks $task -k 4 --drafters eagle eagle3 $SELF --exit-layers 4 7 --mtp-depths 1 3 \
    --no-transformers --output $OUT/selfspec-$task.json
done
echo "== MTP: k = 1, 2, 3 at every depth; transformers' use_mtp=True (3 modules, 3 drafts) on the same weights"
specdec bench --threads 1 --target $Z/target --tasks code-completion --num-prompts 20 --max-new-tokens 128 \
  --backend native -k 1 2 3 --drafters mtp=$Z/mtp mtp=$Z/mtp-parallel --mtp-depths 1 2 3 \
  --output $OUT/selfspec-mtp.json

# Training (one thread each, from the zoo target; folders copied to the zoo without checkpoints):
#   specdec train layerskip --target $Z/target --out RUNS/layerskip --steps 800
#   specdec train mtp --design sequential --depth 3 --target $Z/target --out RUNS/mtp-sequential --steps 800
#   specdec train mtp --design parallel --depth 3 --target $Z/target --out RUNS/mtp-parallel --steps 600
