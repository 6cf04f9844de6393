#!/bin/bash
# The measurements of docs/benchmarks.md "Medusa and the EAGLE family on the zoo target", in one run.
# Run from the repository root with the virtual environment active, on an otherwise idle machine.
Z=src/specdec/zoo/data/target
D=src/specdec/zoo/data/draft
OUT=docs/measurements
for d in float32 bfloat16; do
  echo "== code-completion, greedy, batch 1, one thread, $d"
  specdec bench --threads 1 --target $Z --draft $D --tasks code-completion --num-prompts 20 --max-new-tokens 128 \
    -k 2 4 6 8 --trees 4/2/6 6/2/10 6/3/16 --drafters medusa eagle eagle3 --backend native --dtype $d \
    --no-transformers --output $OUT/drafters-code-$d.json
done
echo "== code-completion, greedy, batch 4, one thread, float32"
specdec bench --threads 1 --target $Z --draft $D --tasks code-completion --num-prompts 20 --max-new-tokens 128 \
  -k 4 --drafters medusa eagle eagle3 --backend native --batch-sizes 1 4 --no-transformers \
  --output $OUT/drafters-code-batch4.json
echo "== Medusa with a 16-node tree"
T16='[[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0], [1, 0, 0], [0, 0, 0, 0]]'
specdec bench --threads 1 --target $Z --tasks code-completion --num-prompts 20 --max-new-tokens 128 -k 4 \
  --drafters medusa --medusa-choices "$T16" --backend native --no-transformers --output $OUT/drafters-medusa16.json
echo "== temperature 0.7"
python docs/measurements/sampled_tau.py 0.7 > $OUT/drafters-sampled.json
