#!/bin/bash
# Run from the repository root after: git worktree add /tmp/base 207d51b~1 (the code before the change).
# DSpark drafting before (a worktree at /tmp/base) and after (this tree), interleaved twice.
OUT=${OUT:-docs/measurements}
for round in 1 2; do
  for side in base new; do
    src=$PWD/src; [ $side = base ] && src=/tmp/base/src
    PYTHONPATH=$src specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 5 \
      --max-new-tokens 128 --drafters dspark --no-transformers --threads 2 -k 4 --json --output $OUT/dspark-draft-$side-$round-zen3-s24.json > /dev/null 2>&1
    python -c "
import json; r = json.load(open('$OUT/dspark-draft-$side-$round-zen3-s24.json'))
plain = [x for x in r['rows'] if x['family'] == 'plain'][0]
d = [x for x in r['rows'] if x['family'] == 'dspark'][0]
print('$side $round', 'plain %.1f' % plain['tokens_per_second'], 'dspark %.1f (%.3fx) tau %.2f draft %.2f ms/step' % (d['tokens_per_second'], d['speedup_vs_plain'], d['tau'], d['draft_ms_per_step']), 'identical', r['outputs_identical'])"
  done
done
