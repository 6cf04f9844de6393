#!/bin/bash
# The measurements of docs/benchmarks.md "DFlash on the zoo target" (issue 13).
# Run from the repository root with the virtual environment active, on an otherwise idle machine.
# RUNS holds the drafters that are not in the zoo: the 1- and 2-layer DFlash variants and the
# phase-1 (short-context) drafter the long-context phase started from (see the training commands below).
set -e
Z=src/specdec/zoo/data/target
D=src/specdec/zoo/data/draft
OUT=docs/measurements
RUNS=${RUNS:-/work/runs}
COMMON="--threads 1 --target $Z --draft $D --num-prompts 20 --max-new-tokens 128 --backend native"

echo "== code-completion: every drafter, DFlash depths 1/2/3 at blocks 4/8/16, transformers' DFlash on the zoo weights"
specdec bench $COMMON --tasks code-completion -k 4 --drafters dflash dflash=$RUNS/dflash1 dflash=$RUNS/dflash2 \
  medusa eagle eagle3 --block-sizes 4 8 16 --output $OUT/dflash-code-completion.json
for task in copy-edit long-context; do
  echo "== $task: every drafter, DFlash at blocks 4/8/16"
  specdec bench $COMMON --tasks $task -k 4 --drafters dflash medusa eagle eagle3 --block-sizes 4 8 16 \
    --no-transformers --output $OUT/dflash-$task.json
done
echo "== long-context: before (phase 1) and after the long-context phase"
specdec bench $COMMON --tasks long-context -k 4 --drafters dflash=$RUNS/dflash dflash=$RUNS/dflash-long \
  --block-sizes 8 16 --no-transformers --output $OUT/dflash-long-phase.json
echo "== code-completion at batch 1, 4 and 8"
specdec bench $COMMON --tasks code-completion -k 4 --drafters dflash eagle --block-sizes 8 16 \
  --batch-sizes 1 4 8 --no-transformers --output $OUT/dflash-batches.json
echo "== temperature 0.7 (every zoo drafter, DFlash at blocks 4 and 8)"
python docs/measurements/sampled_tau.py 0.7 > $OUT/dflash-sampled.json
echo "== offline predicted tau (held-out validation prompts)"
for d in $Z/../dflash $RUNS/dflash1 $RUNS/dflash2 $RUNS/dflash; do
  specdec train evaluate --drafter $d --target $Z --cache-dir $RUNS/eval
done

# Training (one thread each; the zoo's drafter is dflash-long, copied to src/specdec/zoo/data/dflash):
#   specdec train dflash --target $Z --out $RUNS/dflash --steps 1200 --max-minutes 58
#   specdec train dflash --target $Z --out $RUNS/dflash1 --config layers1.json --steps 1100   (killed at 300, --resume)
#   specdec train dflash --target $Z --out $RUNS/dflash2 --config layers2.json --steps 700 --max-minutes 32
#   specdec train dflash --target $Z --out $RUNS/dflash-long --preset dflash-long --init-from $RUNS/dflash
# with layers1.json = {"shape": {"layers": 1}} and layers2.json = {"shape": {"layers": 2}}.
# Plus, phase 1 against phase 2 on code-completion (dflash-long-phase-code.json):
#   specdec bench $COMMON --tasks code-completion -k 4 --drafters dflash=$RUNS/dflash dflash=$RUNS/dflash-long eagle \
#     --block-sizes 4 8 16 --no-transformers --output $OUT/dflash-long-phase-code.json
