#!/bin/bash
# The measurements of docs/serving.md (issue 15): the engine's efficiency at batch 1 and the
# load-aware policy in `specdec bench`, then `specdec bench-serve` (each mode's server in a process of
# its own, streaming clients in this one) for the two drafters that come closest to plain decoding
# on this CPU. Run from the repository root with the virtual environment active, on an otherwise
# idle machine (2 cores: the server on one, the clients on the other).
set -e
Z=src/specdec/zoo/data
OUT=docs/measurements
echo "== batch 1, native: plain, draft model and prompt lookup at k = 1, 2, 4, and load-aware (k <= 4)"
specdec bench --threads 1 --target $Z/target --draft $Z/draft --tasks code-completion --num-prompts 20 \
  --max-new-tokens 128 -k 1 2 4 --load-aware --no-transformers --output $OUT/serving-bench.json
for drafter in prompt-lookup draft-model; do
  echo "== bench-serve, $drafter: plain, fixed k = 4, load-aware (k <= 4) at 1, 4, 16, 64 clients"
  specdec bench-serve --drafter $drafter -k 4 --threads 1 --concurrency 1 4 16 64 --requests-per-client 4 \
    --max-tokens 64 --output $OUT/serving-$drafter.json --plot $OUT/serving-$drafter.png
done
