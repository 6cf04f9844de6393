#!/bin/bash
# The measurements of docs/real-target.md (issue 22): the real target, SmolLM2-135M-Instruct, with the
# drafters trained for it, on held-out ShareGPT and HumanEval prompts. Run from the repository root with
# the virtual environment active, on an otherwise idle machine; the first command fetches and builds
# the target (once).
set -e
OUT=docs/measurements
echo "== training EAGLE-3 (ShareGPT text, the target's distributions as labels; features cached once)"
specdec train eagle3 --target smollm2-135m --out runs/smollm2-eagle3/out --ckpt-dir runs/smollm2-eagle3/ckpt \
  --preset eagle3-sharegpt --steps 300 --threads 2   # stopped at step 165 (kill), then exported with:
specdec train eagle3 --target smollm2-135m --out runs/smollm2-eagle3/out --ckpt-dir runs/smollm2-eagle3/ckpt \
  --resume --max-minutes 0 --threads 2
echo "== the same on the target's own answers (stopped at step 80 the same way)"
specdec train eagle3 --target smollm2-135m --out runs/smollm2-eagle3-self/out --ckpt-dir runs/smollm2-eagle3-self/ckpt \
  --preset eagle3-sharegpt-self --threads 2
echo "== batch 1, float32, 2 threads: every method interleaved, EAGLE-3's fastest setting recorded in its folder"
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 6 --max-new-tokens 128 \
  -k 2 4 --trees 4/2/6 --drafters eagle3 --record --threads 2 --output $OUT/real-bench-float32.json
echo "== the demo"
time specdec demo
echo "== (second session) DFlash on the same data and feature cache: 2 layers, blocks of 8, 400 steps"
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --data-dir runs/smollm2-eagle3/ckpt \
  --out runs/smollm2-dflash/out --ckpt-dir runs/smollm2-dflash/ckpt --threads 2 --max-minutes 75
echo "== EAGLE-3 again, its head and norm starting from the target's (head_from_target), 45 minutes"
specdec train eagle3 --target smollm2-135m --preset eagle3-sharegpt --steps 300 --data-dir runs/smollm2-eagle3/ckpt \
  --out runs/smollm2-eagle3-warm/out --ckpt-dir runs/smollm2-eagle3-warm/ckpt --threads 2 --max-minutes 45 \
  --config <(echo "{\"head_from_target\": true}")   # killed at step 120 (worse than the run below at equal steps)
echo "== the first EAGLE-3 run continued to its planned 300 steps"
specdec train eagle3 --target smollm2-135m --out runs/smollm2-eagle3/out300 --ckpt-dir runs/smollm2-eagle3/ckpt --resume \
  --threads 2 --max-minutes 22
echo "== T(n) in every weight type, 1 and 2 threads, beside llama-bench on the same GGUF files"
python docs/measurements/cost_curves.py --llama-bench "$(bash ../shared/scripts/build-llamacpp.sh)" \
  --output $OUT/cost-curves.json
echo "== the shipped Q4_1 file run as it is, and the float32 folder, with every trained drafter (2 threads)"
specdec bench --target smollm2-135m-q4_1 --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 \
  -k 2 4 --block-sizes 3 5 --drafters eagle3 dflash --threads 2 --output $OUT/real-bench-q4_1.json
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 \
  -k 2 4 --block-sizes 3 5 --drafters eagle3 dflash --record --threads 2 --output $OUT/real-bench-float32-2.json
echo "== (third session, AMD EPYC Zen 3, AVX2 only) DSpark on DFlash's data and features: same run, blocks of 7 drafts"
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --data-dir runs/data --out runs/cache-build/out \
  --ckpt-dir runs/cache-build/ckpt --threads 2 --max-minutes 0   # rebuilds the token ids and the feature cache only
specdec train dspark --target smollm2-135m --preset dspark-sharegpt --data-dir runs/data \
  --out runs/smollm2-dspark/out --ckpt-dir runs/smollm2-dspark/ckpt --threads 2 --max-minutes 70
#   (stopped at step N with a kill when the session's time ran short, then exported:)
specdec train dspark --target smollm2-135m --data-dir runs/data --out runs/smollm2-dspark/out \
  --ckpt-dir runs/smollm2-dspark/ckpt --resume --max-minutes 0 --threads 2
mkdir -p src/specdec/zoo/data/smollm2-135m/dspark && cp runs/smollm2-dspark/out/* src/specdec/zoo/data/smollm2-135m/dspark/
echo "== DSpark beside DFlash (blocks of 8 = 7 drafts, and 7) and EAGLE-3, greedy and at temperature 0.7, batch 1"
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 -k 4 \
  --drafters eagle3 dflash dspark --block-sizes 8 7 --policies conf-min:0.3 confidence --no-transformers \
  --threads 2 --output $OUT/dspark-greedy.json
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 -k 4 \
  --drafters eagle3 dflash dspark --block-sizes 8 --policies conf-min:0.3 confidence --no-transformers \
  --temperature 0.7 --threads 2 --output $OUT/dspark-t07.json   # run with --num-prompts 2 --max-new-tokens 64
echo "== served: plain, DFlash at its block, DSpark cut at a confidence threshold, DSpark with the scheduler"
specdec bench-serve --target smollm2-135m --drafter dspark --modes plain dflash@fixed dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 16 --requests-per-client 1 --max-tokens 16 --max-batch-size 16 \
  --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve.json

# Fourth session (AMD EPYC family 25 model 1, Zen 3: avx2 fma; 2 threads)
# DSpark to DFlash's 400 steps: the run above, resumed from its step-259 checkpoint
specdec train dspark --target smollm2-135m --data-dir runs/data --out runs/smollm2-dspark/out \
  --ckpt-dir runs/smollm2-dspark/ckpt --threads 2 --resume --max-minutes 40
cp runs/smollm2-dspark/out/* src/specdec/zoo/data/smollm2-135m/dspark/
# after the AVX2 kernel work (quantized tiles, two-thread split by weight bytes, next-group prefetch)
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 -k 4 \
  --drafters eagle3 dflash dspark --block-sizes 8 7 --policies conf-min:0.3 confidence --no-transformers \
  --threads 2 --output $OUT/kernels-avx2-greedy.json
python docs/measurements/cost_curves.py --threads 2 --output $OUT/cost-curves-zen3.json
# after torch's threads were kept off during engine steps
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 -k 4 \
  --drafters eagle3 dflash --no-transformers --threads 2 --output $OUT/kernels-avx2-glue-greedy.json
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 -k 4 \
  --drafters dflash dspark --block-sizes 8 7 --policies conf-min:0.3 confidence --no-transformers \
  --threads 2 --output $OUT/dspark-400-greedy.json
python docs/measurements/cost_curves.py --threads 2 --output $OUT/cost-curves-zen3-glue.json

# Sixth session (AMD EPYC family 25 model 17, Zen 4; 2 threads): EAGLE-1 and Medusa on the target's own head,
# one final-layer feature cache (built by the first command, 20 min)
specdec train eagle --target smollm2-135m --preset eagle-sharegpt --data-dir runs/data \
  --out runs/smollm2-eagle1/out --ckpt-dir runs/smollm2-eagle1/ckpt --threads 2 --max-minutes 38
specdec train medusa --target smollm2-135m --preset medusa-sharegpt --data-dir runs/data \
  --out runs/smollm2-medusa/out --ckpt-dir runs/smollm2-medusa/ckpt --threads 2 --max-minutes 35
cp runs/smollm2-eagle1/out/* src/specdec/zoo/data/smollm2-135m/eagle/
cp runs/smollm2-medusa/out/* src/specdec/zoo/data/smollm2-135m/medusa/
# early exit on the unmodified target
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 \
  -k 2 4 --drafters early-exit=$HOME/.cache/specdec/models/smollm2-135m --exit-layers 10 20 --no-transformers --threads 2
# every drafter, bfloat16, after the kernel fixes
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 3 --max-new-tokens 64 \
  -k 2 4 --drafters eagle eagle3 medusa dflash dspark --block-sizes 8 --policies confidence --no-transformers \
  --threads 2 --record --output $OUT/real-bench-bfloat16-s6.json
python docs/measurements/forward_ab.py 2 bfloat16 START.so smollm2-135m 1,2,4,5,8,16   # START.so: the session's first build

# Seventh session (AMD EPYC family 25 model 17, Zen 4; 2 threads): the draft model and MTP on the same cache
specdec train distill --target smollm2-135m --out runs/draft/out --ckpt-dir runs/draft/ckpt --data-dir runs/data \
  --threads 2 --max-minutes 50
specdec train mtp --target smollm2-135m --out runs/mtp/out --ckpt-dir runs/mtp/ckpt --data-dir runs/data \
  --threads 2 --max-minutes 32
cp runs/draft/out/* src/specdec/zoo/data/smollm2-135m/draft/; cp runs/mtp/out/* src/specdec/zoo/data/smollm2-135m/mtp/
D=src/specdec/zoo/data/smollm2-135m/draft
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 20 --max-new-tokens 128 \
  -k 2 4 --trees 4/2/6 --draft $D --drafters eagle eagle3 medusa dflash dspark mtp --block-sizes 8 --no-transformers \
  --threads 2 --record --output $OUT/real-bench-bfloat16-s7.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 16 --max-batch-size 16 \
  --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-s7.json
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 4 --draft $D --drafters eagle3 dflash mtp --block-sizes 8 --threads 2 --output $OUT/real-bench-float32-s7.json
time specdec demo

# Eighth session (AMD EPYC family 25 model 17, Zen 4; 2 threads): draft vocabularies for the drafters that read
# the target's head, then every drafter again
D=src/specdec/zoo/data/smollm2-135m
for method in eagle mtp medusa; do
  specdec train draft-vocab --drafter $D/$method --target smollm2-135m --size 8192
done
# the same folders without the file (copies kept from before it), side by side
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 20 --max-new-tokens 128 \
  -k 2 --drafters eagle eagle=runs/s8/full/eagle mtp mtp=runs/s8/full/mtp eagle3 --no-transformers --threads 2 \
  --output $OUT/real-bench-draft-vocab-s8.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 20 --max-new-tokens 128 \
  -k 2 4 --trees 4/2/6 --draft $D/draft --drafters eagle eagle3 medusa dflash dspark mtp --block-sizes 8 \
  --no-transformers --threads 2 --record --output $OUT/real-bench-bfloat16-s8.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --max-batch-size 16 \
  --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-s8.json   # run again after the last change
time specdec demo
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 --draft $D/draft --drafters eagle eagle3 medusa dflash dspark mtp --block-sizes 8 --no-transformers \
  --threads 1 --output $OUT/real-bench-bfloat16-1thread-s8.json
# beside llama.cpp (pip install llama-cpp-python) on the shipped Q4_1 file
for task in sharegpt humaneval; do
  python -m specdec.commands.llamacpp --target smollm2-135m-q4_1 --tasks $task --num-prompts 10 --max-new-tokens 128 \
    -k 4 --threads 2 --json $OUT/llamacpp-q4_1-$task-s8.json
done

# Ninth session (AMD EPYC family 25 model 17, Zen 4; 2 threads): EAGLE-1 continued on the target's own answers,
# draft vocabularies for the draft model, DFlash and DSpark, grouped prefill
# the target's answers (48 min) and their features, layers 2/15/27 and the final one (21 min, 4.0 GiB)
echo '{"source": "sharegpt-self", "train_sequences": 2048, "prefix_len": 256, "generated_len": 192}' > self.json
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --config self.json --data-dir runs/data \
  --out runs/cache-build/out --ckpt-dir runs/cache-build/ckpt --threads 2 --max-minutes 0
cp -r $D/eagle runs/s9/eagle-old   # the folder before, for the side-by-side run
echo '{"head_vocab": 8192, "optim": {"steps": 1920, "lr": 6e-4, "warmup_steps": 20, "eval_every": 384}}' > eagle-self.json
specdec train eagle --target smollm2-135m --preset eagle-sharegpt-self --config eagle-self.json \
  --init-from $D/eagle --data-dir runs/data --out runs/s9/eagle-self/out --ckpt-dir runs/s9/eagle-self/ckpt \
  --threads 2 --max-minutes 46   # 32.8 min; then copied into $D/eagle
for method in dflash dspark draft; do cp -r $D/$method runs/s9/$method-full; done   # before the file
for method in dflash dspark draft; do specdec train draft-vocab --drafter $D/$method --target smollm2-135m; done
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 16 --max-new-tokens 128 \
  -k 2 --draft $D/draft --drafters eagle=runs/s9/eagle-self/out eagle=runs/s9/eagle-old dflash dflash=runs/s9/dflash-full \
  dspark dspark=runs/s9/dspark-full --block-sizes 8 --no-transformers --threads 2 --record --output $OUT/real-bench-s9.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 16 --max-new-tokens 128 \
  -k 2 --draft runs/s9/draft-full --no-transformers --threads 2 --output $OUT/real-bench-draft-full-s9.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dspark@confidence \
  --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --max-batch-size 16 --tasks sharegpt --threads 2 \
  --in-process --output $OUT/dspark-serve-s9.json

# Tenth session (AMD EPYC family 25 model 17, Zen 4; 2 threads): EAGLE-3, DFlash and DSpark continued on the
# target's own answers (the ninth session's data and 4-layer feature cache in runs/data), the scheduler corrected
echo '{"train_sequences": 2048, "ttt_steps": 3, "optim": {"steps": 400, "lr": 6e-4, "warmup_steps": 15, "eval_every": 100}}' > eagle3-self.json
cp -r $D/eagle3 runs/s10/old/eagle3   # the folder before, for the side-by-side run
specdec train eagle3 --target smollm2-135m --preset eagle3-sharegpt-self --config eagle3-self.json --init-from $D/eagle3 \
  --data-dir runs/data --out runs/s10/eagle3-self/out --ckpt-dir runs/s10/eagle3-self/ckpt --threads 2 --max-minutes 55
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 16 --max-new-tokens 128 \
  -k 2 3 --drafters eagle3=runs/s10/eagle3-self/out eagle3=runs/s10/old/eagle3 eagle --no-transformers --threads 2 \
  --output $OUT/real-bench-eagle3-s10.json   # then copied into $D/eagle3
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 16 64 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-s10.json
# DFlash and DSpark on equal CPU budgets (about 20 min each: 3.4 and 6.2 s a step measured, so 340 and 190 steps)
for run in dflash:340:15:170 dspark:190:10:95; do IFS=: read m steps warmup every <<< "$run"
  echo "{\"source\": \"sharegpt-self\", \"train_sequences\": 2048, \"prefix_len\": 256, \"generated_len\": 192, \"optim\": {\"steps\": $steps, \"lr\": 6e-4, \"warmup_steps\": $warmup, \"eval_every\": $every}}" > $m-self.json
  cp -r $D/$m runs/s10/old/$m
  specdec train $m --target smollm2-135m --preset $m-sharegpt --config $m-self.json --init-from $D/$m --data-dir runs/data \
    --out runs/s10/$m-self/out --ckpt-dir runs/s10/$m-self/ckpt --threads 2 --max-minutes 24
done
# EAGLE-1 from scratch on the text and on the target's answers, 8 minutes each (runs/s10/eagle-cmp.sh)
echo '{"head_vocab": 8192, "optim": {"steps": 420, "lr": 2e-3, "warmup_steps": 30, "eval_every": 210}}' > eagle-cmp.json
for preset in eagle-sharegpt eagle-sharegpt-self; do
  specdec train eagle --target smollm2-135m --preset $preset --config eagle-cmp.json --data-dir runs/data \
    --out runs/s10/cmp-$preset/out --ckpt-dir runs/s10/cmp-$preset/ckpt --threads 2 --max-minutes 8
done

# Eleventh session (AMD EPYC family 25 model 17, Zen 4): kernels against the session's first build, interleaved
git show 14b7eff:src/specdec/models/kernels.c > /tmp/k_s10.c
C=~/.cache/specdec/models   # smollm2-135m (the safetensors folder) and smollm2-135m-q4_1 (the shipped GGUF), built on first use
for th in 2 1; do for spec in "smollm2-135m bfloat16" "smollm2-135m-q4_1 bfloat16" "smollm2-135m float32"; do set -- $spec
  python docs/measurements/forward_ab_sources.py $th $C/$1 /tmp/k_s10.c src/specdec/models/kernels.c 20 1,2,4,5,8,16,17,32,64 $2
done; done   # -> measurements/forward-ab-s11.txt
python docs/measurements/products_hot.py 2; python docs/measurements/block_times.py 2 bfloat16 $C/smollm2-135m 15
# EAGLE-3 continued once more (53 min), then side by side with the folder before
echo '{"train_sequences": 2048, "ttt_steps": 3, "optim": {"steps": 600, "lr": 4e-4, "warmup_steps": 10, "eval_every": 200}}' > eagle3-self.json
cp -r $D/eagle3 runs/s11/old/eagle3
specdec train eagle3 --target smollm2-135m --preset eagle3-sharegpt-self --config eagle3-self.json --init-from $D/eagle3 \
  --data-dir runs/data --out runs/s11/eagle3/out --ckpt-dir runs/s11/eagle3/ckpt --threads 2 --max-minutes 55
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 16 --max-new-tokens 128 \
  -k 2 3 --drafters eagle3=runs/s11/eagle3/out eagle3=runs/s11/old/eagle3 eagle --no-transformers --threads 2 \
  --output $OUT/real-bench-eagle3-s11.json   # then the fastest setting recorded (bench.record_fastest) and copied into $D/eagle3

# Twelfth session (AMD EPYC family 25 model 17, Zen 4; 2 threads): serving copies only what moves, the scheduler
# does not probe a clear loss; the target's answers doubled to 4,096 (the first 2,048 reused, 2,048 generated)
python docs/measurements/serve_batch.py 64 plain never+prof          # the profile; then `64 plain never` before/after
for r in a b c; do   # run a also had dflash@fixed dspark@conf-min:0.3, and ran before the probe gate
  specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dspark@confidence \
    --concurrency 1 4 16 64 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt --threads 2 \
    --in-process --output $OUT/dspark-serve-s12$r.json
done
echo '{"source": "sharegpt-self", "train_sequences": 4096, "prefix_len": 256, "generated_len": 192}' > self4096.json
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --config self4096.json --data-dir runs/data \
  --out runs/s12/data/out --ckpt-dir runs/s12/data/ckpt --threads 2 --max-minutes 0   # ids and the 4-layer feature cache
echo '{"train_sequences": 4096, "ttt_steps": 3, "optim": {"steps": 360, "lr": 5e-4, "warmup_steps": 10, "eval_every": 120}}' > eagle3-4096.json
specdec train eagle3 --target smollm2-135m --preset eagle3-sharegpt-self --config eagle3-4096.json --init-from $D/eagle3 \
  --data-dir runs/data --out runs/s12/eagle3/out --ckpt-dir runs/s12/eagle3/ckpt --threads 2 --max-minutes 32
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 16 --max-new-tokens 128 \
  -k 2 --drafters eagle3=runs/s12/eagle3/out eagle3=$D/eagle3 eagle --no-transformers --threads 2 \
  --output $OUT/real-bench-eagle3-s12.json   # then the k = 2 setting recorded in its config and copied into $D/eagle3

# Thirteenth session (Intel Xeon, family 6 model 167, AMX-BF16/INT8; 2 threads): bfloat16 and quantized products
# on the tile unit; before = commit 87540c3 on the same machine, after = this session's kernels
python docs/measurements/cost_curves.py --threads 1 2 --output $OUT/cost-curves-amx-s13.json
for amx in 1 0; do
  SPECDEC_AMX=$amx specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 \
    --max-new-tokens 128 --drafters eagle3 eagle dflash dspark --no-transformers --threads 2 \
    --output $OUT/real-bench-$([ $amx = 1 ] && echo amx || echo noamx)-s13.json
done
echo '{"source": "sharegpt-self", "train_sequences": 4096, "prefix_len": 256, "generated_len": 192}' > self4096.json
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --config self4096.json --data-dir runs/data \
  --out runs/s13/data/out --ckpt-dir runs/s13/data/ckpt --threads 2 --max-minutes 0   # 27 min of answers, 17 of features here
cp -r $D/eagle runs/s13/eagle-old
echo '{"train_sequences": 4096, "head_vocab": 8192, "optim": {"steps": 1400, "lr": 5e-4, "warmup_steps": 20, "eval_every": 700}}' > eagle-4096.json
specdec train eagle --target smollm2-135m --preset eagle-sharegpt-self --config eagle-4096.json --init-from $D/eagle \
  --data-dir runs/data --out runs/s13/eagle/out --ckpt-dir runs/s13/eagle/ckpt --threads 2 --max-minutes 15
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  -k 2 --drafters eagle=runs/s13/eagle/out eagle=runs/s13/eagle-old --no-transformers --threads 2 \
  --output $OUT/real-bench-eagle-s13.json   # then copied into $D/eagle with its k = 2 setting recorded

# Fourteenth session (the same Xeon, AMX; 2 threads). Trees before and after the native argmax in tree verification
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 -k 2 \
  --trees 3/2/4 4/2/6 5/3/10 --drafters eagle --no-transformers --threads 2 --output $OUT/real-bench-trees-after-s14.json
# DFlash and DSpark on equal planned budgets (2.2 and 3.1 s a step measured: 545 and 390 steps), then EAGLE-3, all on the
# thirteenth session's 4,096 answers and feature cache
mkdir -p runs/s14/old && for m in dflash dspark eagle3; do cp -r $D/$m runs/s14/old/$m; done
for run in dflash:545:15 dspark:390:10; do IFS=: read m steps warmup <<< "$run"
  echo "{\"source\": \"sharegpt-self\", \"train_sequences\": 4096, \"prefix_len\": 256, \"generated_len\": 192, \"optim\": {\"steps\": $steps, \"lr\": 6e-4, \"warmup_steps\": $warmup, \"eval_every\": $steps}}" > $m-4096.json
  specdec train $m --target smollm2-135m --preset $m-sharegpt --config $m-4096.json --init-from $D/$m --data-dir runs/data \
    --out runs/s14/$m/out --ckpt-dir runs/s14/$m/ckpt --threads 2 --max-minutes 26
done
echo '{"train_sequences": 4096, "ttt_steps": 3, "optim": {"steps": 525, "lr": 4e-4, "warmup_steps": 10, "eval_every": 525}}' > eagle3-4096.json
specdec train eagle3 --target smollm2-135m --preset eagle3-sharegpt-self --config eagle3-4096.json --init-from $D/eagle3 \
  --data-dir runs/data --out runs/s14/eagle3/out --ckpt-dir runs/s14/eagle3/ckpt --threads 2 --max-minutes 30
O=runs/s14
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  --drafters dflash=$O/dflash/out dflash=$O/old/dflash dspark=$O/dspark/out dspark=$O/old/dspark \
  --no-transformers --threads 2 --output $OUT/real-bench-block-s14.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  --temperature 0.7 --drafters dflash=$O/dflash/out dspark=$O/dspark/out eagle3=$O/eagle3/out eagle \
  --no-transformers --threads 2 --output $OUT/real-bench-t07-after-s14.json   # before: the previous commit
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  -k 2 4 --drafters dflash=$O/dflash/out dspark=$O/dspark/out eagle3=$O/eagle3/out --record \
  --no-transformers --threads 2 --output $OUT/real-bench-record-s14.json   # then the three folders copied into $D
# Kernels: each build in its own process, alternated (before = commit d49ce7d's kernels.c)
git show d49ce7d:src/specdec/models/kernels.c > /tmp/before.c; cp src/specdec/models/kernels.c /tmp/after.c
C=~/.cache/specdec/models
for spec in "smollm2-135m-q4_1 float32" "smollm2-135m bfloat16" "smollm2-135m float32"; do set -- $spec
  for i in 1 2 3; do for s in before after; do python docs/measurements/forward_build.py /tmp/$s.c $C/$1 $2 1,8,16,32 21; done; done
done
python docs/measurements/products_variants.py 2 float32 1,8,16,32 /tmp/before.c /tmp/variant1.c ...   # the float32 prefetch variants

# ---- fifteenth session: an AVX2-only Zen 1 (AMD EPYC family 23 model 1) ----
BIN=$(bash ../shared/scripts/build-llamacpp.sh)
python docs/measurements/cost_curves.py --llama-bench $BIN --threads 2 1 --output $OUT/cost-curves-zen1-s15.json
# Kernels before/after: /tmp/k_old.c = this kernels.c with sd_bf16_halves() returning 0 and QSTREAM_ROWS 0
for m in "smollm2-135m bfloat16" "Q8_0.gguf float32" "smollm2-135m-q4_1 float32"; do set -- $m
  for i in 1 2; do for s in /tmp/k_old.c src/specdec/models/kernels.c; do
    python docs/measurements/forward_build.py $s $1 $2 1,2,4,5,8,16 15; done; done
done
python docs/measurements/products_ab.py 2 bfloat16 OLD.so 1,2,4,8,16      # OLD.so: the previous build
python docs/measurements/products_ab.py 2 float32 OLD.so 1,2 Q8_0.gguf
# llama.cpp side by side (llama-cpp-python's package from its source, the library from $BIN)
for t in smollm2-135m Q8_0.gguf smollm2-135m-q4_1; do
  PYTHONPATH=LLAMA_CPP_PYTHON_SRC LLAMA_CPP_LIB_PATH=$BIN python -m specdec.commands.llamacpp --target $t \
    --tasks sharegpt --num-prompts 4 --max-new-tokens 96 -k 4 --threads 2 --no-repack --json $OUT/llamacpp-...-zen1-s15.json
done
specdec demo --dtype float32 > $OUT/demo-zen1-float32-s15.txt; specdec demo --dtype bfloat16 > $OUT/demo-zen1-bfloat16-s15.txt

# ---- sixteenth session: the same AVX2-only Zen 1 (AMD EPYC family 23 model 1) ----
# OLD.so: the build before (kernels.build() at the previous commit, copied aside)
for th in 2 1; do for f in smollm2-135m-q4_1 Q8_0.gguf; do
  python docs/measurements/products_ab.py $th float32 OLD.so 1,2,3,4,8,16 $f; done; done > $OUT/products-ab-zen1-s16.txt
python docs/measurements/attention_ab.py 2 OLD.so > $OUT/attention-ab-zen1-s16.txt
python -c "from specdec.commands.gguf import export; from specdec.zoo import zoo_path; from pathlib import Path
export(zoo_path('smollm2-135m'), Path('BF16.gguf'), 'bf16')"
PYTHONPATH=LLAMA_CPP_PYTHON_SRC LLAMA_CPP_LIB_PATH=$BIN python -m specdec.commands.llamacpp --target BF16.gguf \
  --tasks sharegpt --num-prompts 4 --max-new-tokens 96 -k 4 --threads 2 --no-repack --json $OUT/llamacpp-bf16-zen1-s16.json
# DSpark trees beside its chain and DFlash's block
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 5 --max-new-tokens 96 \
  -k 7 --trees 4/2/6 4/3/8 5/3/10 --drafters dflash dspark --no-transformers --threads 2 --output $OUT/dspark-trees-zen1-s16.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 5 --max-new-tokens 96 \
  -k 7 --trees 4/3/8 5/3/10 --drafters dflash dspark --no-transformers --threads 2 --temperature 0.7 --output $OUT/dspark-trees-t07-zen1-s16.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 \
  -k 7 --trees 3/2/4 4/2/6 --drafters dspark --record --no-transformers --threads 2 --output $OUT/dspark-record-zen1-s16.json

# ---- seventeenth session: the same AVX2-only Zen 1; retrieval drafting (REST) ----
python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m/retrieval'))"   # the datastore, once
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  -k 2 4 --trees 4/2/6 --drafters retrieval eagle eagle3 --no-transformers --threads 2 --output $OUT/retrieval-zen1-s17.json
python docs/measurements/retrieval_variants.py 4 96 $OUT/retrieval-variants-zen1-s17.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  -k 2 3 4 --trees 3/2/4 4/2/6 --drafters retrieval --no-transformers --threads 2 --record --output $OUT/retrieval-record-zen1-s17.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  -k 2 4 --trees 4/2/6 --drafters retrieval --no-transformers --threads 2 --temperature 0.7 --output $OUT/retrieval-t07-zen1-s17.json
specdec demo > $OUT/demo-zen1-s17.txt 2>&1

# ---- eighteenth session: an AVX2-only Zen 3 (AMD EPYC family 25 model 1); the target's own answers as retrieval data,
# AVX2 bfloat16 tiles ----
mv ~/.cache/specdec/datastores/smollm2-135m ds-base                          # the seventeenth session's datastore, kept aside
specdec datastore --target smollm2-135m --out ds-answers --sources answers   # 4,096 greedy answers: 43 min once, then cached
specdec datastore --target smollm2-135m --out ds-merged --sources sharegpt stdlib answers
python docs/measurements/retrieval_offline.py 16 128 $OUT/retrieval-offline-zen3-s18.json base=ds-base answers=ds-answers \
  both=ds-base+ds-answers merged=ds-merged
python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m/retrieval'))"   # now with the committed answers
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  -k 2 3 4 --trees 3/2/4 4/2/6 --drafters retrieval retrieval=ds-base --no-transformers --threads 2 \
  --output $OUT/retrieval-answers-zen3-s18.json
# A.c: kernels.c of the commit before (git show c9343e6:src/specdec/models/kernels.c)
python docs/measurements/products_variants.py 2 bfloat16 1,2,3,4,5,6,8 A.c src/specdec/models/kernels.c
python docs/measurements/products_variants.py 2 float32 1,2,3,4,5,6,8,16 A.c E.c   # E: the bfloat16 rule for float32 too
python docs/measurements/forward_ab_sources.py 2 $(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m'))") \
  A.c src/specdec/models/kernels.c 15 1,2,3,4,5,6,8 bfloat16 > $OUT/forward-ab-tiles-zen3-s18.txt
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  -k 2 3 4 --trees 4/2/6 --drafters retrieval eagle eagle3 --no-transformers --threads 2 --record \
  --output $OUT/tiles-bench-zen3-s18.json
python docs/measurements/forward_ab_sources.py 2 $(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m'))") \
  EVEN.c src/specdec/models/kernels.c 15 1,3,5,7,8,9,16 bfloat16 > $OUT/forward-ab-rest-zen3-s18.txt   # EVEN.c: commit fbac5e7's
S=$(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m/retrieval'))")
python docs/measurements/retrieval_offline.py 16:32 128 $OUT/retrieval-ctx-validate-zen3-s18.json ctx3=$S@context_max_ngram=3 ctx8=$S
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 \
  -k 2 3 4 5 --trees 4/2/6 --drafters retrieval --no-transformers --threads 2 --record --output $OUT/retrieval-ctx8-zen3-s18.json
specdec demo > $OUT/demo-zen3-s18.txt 2>&1   # after the answers and the 4/5-row tiles; again at the end: demo-zen3-s18-final.txt
specdec bench --target smollm2-135m-q4_1 --tasks sharegpt humaneval --num-prompts 8 --max-new-tokens 128 -k 2 3 4 \
  --drafters retrieval=$S --no-transformers --threads 2 --output $OUT/retrieval-q4_1-zen3-s18.json

# ---- nineteenth session: the same Zen 3 model (AMD EPYC family 25 model 1); the shipped Q4_1 file as draft model of
# its float model, float32 row blocks and next-group prefetch ----
BIN=$(bash ../shared/scripts/build-llamacpp.sh)
python docs/measurements/cost_curves.py --llama-bench $BIN --threads 2 1 --output $OUT/cost-curves-zen3-s19.json  # before the row blocks
specdec bench --target smollm2-135m --draft smollm2-135m-q4_1 --dtype float32 --tasks sharegpt humaneval --num-prompts 8 \
  --max-new-tokens 128 -k 4 6 8 10 --no-transformers --threads 2 --output $OUT/qdraft-float32-zen3-s19.json
specdec bench --target smollm2-135m --draft smollm2-135m-q4_1 --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 \
  --max-new-tokens 128 -k 3 4 6 --drafters retrieval --no-transformers --threads 2 --output $OUT/qdraft-bfloat16-zen3-s19.json
for q in q4_0 q4_1; do   # the float folder quantized again at load, instead of the file's own blocks
  specdec bench --target smollm2-135m --draft smollm2-135m --draft-quantize $q --dtype float32 --tasks sharegpt humaneval \
    --num-prompts 4 --max-new-tokens 96 -k 6 8 --no-transformers --threads 2
done
# S18.c: kernels.c of the eighteenth session's last commit (git show b72ef96:src/specdec/models/kernels.c)
python docs/measurements/products_variants.py 2 float32 1,2,3,4,5,6,7,8,9,12,16,17 S18.c src/specdec/models/kernels.c
for d in float32 bfloat16; do
  python docs/measurements/forward_ab_sources.py 2 $(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m'))") \
    S18.c src/specdec/models/kernels.c 21 1,2,4,5,7,8,9,12,16,17 $d > $OUT/forward-ab-rows-$d-zen3-s19.txt
done
python docs/measurements/cost_curves.py --threads 2 --output $OUT/cost-curves-zen3-s19-after.json
specdec demo > $OUT/demo-zen3-s19.txt 2>&1   # with the Q4_1 file as draft model
# A.c: kernels.c before the 16 KiB stream-ahead (git show fa0d4b7:src/specdec/models/kernels.c)
python docs/measurements/forward_ab_sources.py 2 $(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m'))") \
  A.c src/specdec/models/kernels.c 21 1,2,3,4,5,6 bfloat16 > $OUT/forward-ab-ahead-bfloat16-zen3-s19.txt
specdec bench --target smollm2-135m --draft smollm2-135m-q4_1 --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 8 \
  --max-new-tokens 128 -k 2 3 4 5 --drafters retrieval --no-transformers --threads 2 --output $OUT/final-bfloat16-zen3-s19.json
specdec bench --target smollm2-135m --draft smollm2-135m-q4_1 --dtype float32 --tasks sharegpt humaneval --num-prompts 4 \
  --max-new-tokens 128 -k 6 8 --temperature 0.7 --no-transformers --threads 2 --output $OUT/qdraft-t07-float32-zen3-s19.json
specdec bench --target smollm2-135m --draft smollm2-135m-q4_1 --dtype float32 --tasks sharegpt humaneval --num-prompts 4 \
  --max-new-tokens 96 -k 4 6 8 --no-transformers --threads 1 --output $OUT/qdraft-float32-1thread-zen3-s19.json

# ---- twentieth session: the same Zen 3 model (AMD EPYC family 25 model 1); lookahead decoding ----
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 -k 2 --trees 2/2/4 \
  --drafters lookahead --lookahead-window 2 --lookahead-ngram 3 --lookahead-guesses 2 --no-transformers --threads 2 \
  --output $OUT/lookahead-f32-232-zen3-s20.json
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 -k 3 --trees 3/2/6 \
  --drafters lookahead --lookahead-window 2 --lookahead-ngram 4 --lookahead-guesses 2 --no-transformers --threads 2 \
  --output $OUT/lookahead-f32-242-zen3-s20.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 -k 3 \
  --trees 3/2/6 --drafters lookahead --no-transformers --threads 2 --output $OUT/lookahead-bf16-zen3-s20.json
for s in "2 3 2" "3 3 3" "2 4 2" "4 4 4" "6 3 6"; do set -- $s   # the first sweep of window sizes
  specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 3 --max-new-tokens 96 -k 3 --trees 3/4/8 \
    --drafters lookahead --lookahead-window $1 --lookahead-ngram $2 --lookahead-guesses $3 --no-transformers --threads 2
done
python docs/measurements/lookahead_ablation.py 2 3 2; python docs/measurements/lookahead_ablation.py 4 4 4
specdec demo > $OUT/demo-zen3-s20.txt 2>&1   # with lookahead beside the others
# the Q4_1 file drafting over draft vocabularies of 24576 / 16384 / 8192 rows (the first two written by
# `specdec train draft-vocab --drafter DIR --target smollm2-135m --size N` into copies of its folder)
python docs/measurements/draft_vocab_ab.py bfloat16 4 8 /tmp/qv24576/draft_vocab.json /tmp/qv16384/draft_vocab.json \
  src/specdec/zoo/data/smollm2-135m/draft/draft_vocab.json > $OUT/qdraft-vocab-bf16-zen3-s20.txt
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 -k 3 --trees 3/2/6 \
  --drafters lookahead --temperature 0.7 --no-transformers --threads 2 --output $OUT/lookahead-t07-f32-zen3-s20.json
specdec bench --target smollm2-135m-q4_1 --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 -k 3 --trees 3/2/6 \
  --drafters lookahead --no-transformers --threads 2 --output $OUT/lookahead-q4_1-zen3-s20.json
# llama.cpp's lookahead example on the same file (W, N, G fixed in its source), the first held-out ShareGPT prompt
BIN=$(bash ../shared/scripts/build-llamacpp.sh); GGUF=$(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m-q4_1') / 'model.gguf')")
PROMPT=$(python -c "from specdec.zoo.tasks import load_tasks; from specdec.backends.hf import load_tokenizer; from specdec.zoo import zoo_path; print(load_tasks('sharegpt', tokenizer=load_tokenizer(zoo_path('smollm2-135m')))[0])")
($BIN/llama-lookahead -m $GGUF -p "$PROMPT" -n 128 -t 2 --temp 0 -c 2048 2>&1 | grep -E " I (encoded|decoded|W =|N =|G =|n_predict|n_accept)"
 $BIN/llama-bench -m $GGUF -p 0 -n 128 -t 2 -r 3 | tail -3) > $OUT/llamacpp-lookahead-zen3-s20.txt
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 -k 3 \
  --drafters lookahead --policies load-aware --no-transformers --threads 2 --output $OUT/lookahead-loadaware-bf16-zen3-s20.json

# ---- twenty-first session: the same Zen 3 model (AMD EPYC family 25 model 1); AVX2 quantized tiles, quantized
# products split from 128 KiB, a copy of the target drafting takes the prompt from the target's cache ----
git show 2af679f:src/specdec/models/kernels.c > A.c   # before the AVX2 quantized tiles
python docs/measurements/forward_ab_runs.py smollm2-135m-q4_1 1,2,4,5,6,8,16 float32 4 A.c src/specdec/models/kernels.c
python -c "import sys; sys.path.insert(0, 'docs/measurements'); from cost_curves import export; from specdec.zoo import zoo_path; \
from pathlib import Path; export(zoo_path('smollm2-135m'), Path('Q8_0.gguf'), 'q8_0')"
python docs/measurements/forward_ab_runs.py Q8_0.gguf 1,2,4,5,6,8,16 float32 3 A.c src/specdec/models/kernels.c
python docs/measurements/draft_prompt_ab.py bfloat16 4 64 4 2 > $OUT/draft-prompt-bf16-zen3-s21.txt
python docs/measurements/draft_prompt_ab.py float32 6 64 4 2 > $OUT/draft-prompt-f32-zen3-s21.txt
specdec bench --target smollm2-135m --draft smollm2-135m-q4_1 --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 4 \
  --max-new-tokens 64 -k 3 4 5 6 8 --no-transformers --threads 2 --output $OUT/qdraft-k-bf16-zen3-s21.json
specdec demo > $OUT/demo-zen3-s21.txt 2>&1
python docs/measurements/cost_curves.py --threads 2 --output $OUT/cost-curves-zen3-s21.json
python docs/measurements/parallel_bytes_ab.py smollm2-135m-q4_1 float32 524288,262144,131072,65536,32768 1,2
python docs/measurements/parallel_bytes_ab.py Q8_0.gguf float32 524288,131072,65536,32768 1,2
python docs/measurements/llamacpp_draft_pair.py $BIN 4 4 64 > $OUT/llamacpp-draft-pair-zen3-s21.txt
git show 834cd54:src/specdec/models/kernels.c > B.c   # before the AVX2 attention tiles (268fd2c)
python docs/measurements/attention_rows_ab.py 3 B.c src/specdec/models/kernels.c
for run in 1 2; do   # the load-aware policy with the Q4_1 file drafting (docs/serving.md, twenty-first session)
  specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter draft-model --draft smollm2-135m-q4_1 -k 4 \
    --modes plain fixed load-aware --concurrency 1 4 16 --requests-per-client 3 --max-tokens 64 --max-batch-size 16 \
    --tasks sharegpt --threads 2 --in-process --output $OUT/serve-qdraft-zen3-s21-$run.json
done

# ---- twenty-second session: the same Zen 3 model (AMD EPYC family 25 model 1); the serving engine's upkeep ----
git worktree add /tmp/old 2df9756   # the code before: PYTHONPATH=/tmp/old/src runs it
for run in 1 2; do for mode in plain load-aware; do for v in before after; do
  if [ $v = before ]; then export PYTHONPATH=/tmp/old/src; else unset PYTHONPATH; fi
  echo "== $v $mode $run"; python docs/measurements/serve_upkeep.py 16 $mode
done; done; done > $OUT/serve-upkeep-zen3-s22.txt 2>&1
for run in 1 2; do for v in after before; do   # served, alternating
  if [ $v = before ]; then export PYTHONPATH=/tmp/old/src; else unset PYTHONPATH; fi
  specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter draft-model --draft smollm2-135m-q4_1 -k 4 \
    --modes plain fixed load-aware --concurrency 1 4 16 --requests-per-client 3 --max-tokens 64 --max-batch-size 16 \
    --tasks sharegpt --threads 2 --in-process --output $OUT/serve-qdraft-zen3-s22-$v-$run.json
done; done
git worktree add /tmp/mid bb39d28   # the policy before its estimates changed; the same served command, alternating
for run in 1 2; do for v in after before; do
  if [ $v = before ]; then export PYTHONPATH=/tmp/mid/src; else unset PYTHONPATH; fi
  specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter draft-model --draft smollm2-135m-q4_1 -k 4 \
    --modes plain fixed load-aware --concurrency 1 4 16 --requests-per-client 3 --max-tokens 64 --max-batch-size 16 \
    --tasks sharegpt --threads 2 --in-process --output $OUT/serve-policy-zen3-s22-$v-$run.json
done; done
unset PYTHONPATH
for run in 1 2; do   # the DSpark confidence scheduler with the new profile and drafting cost
  specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dspark@confidence \
    --concurrency 1 4 16 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt --threads 2 \
    --in-process --output $OUT/dspark-serve-s22-$run.json
done
git worktree add /tmp/head 8e27577   # caches zeroed at allocation; the same trace against uninitialised caches
for run in 1 2; do for mode in plain load-aware; do for v in before after; do
  if [ $v = before ]; then export PYTHONPATH=/tmp/head/src; else unset PYTHONPATH; fi
  echo "== $v $mode $run"; python docs/measurements/serve_upkeep.py 16 $mode
done; done; done > $OUT/serve-upkeep-empty-zen3-s22.txt 2>&1
specdec demo > $OUT/demo-zen3-s22.txt 2>&1   # the README first command after this session's changes

# ---- twenty-third session: the same Zen 3 model (AMD EPYC family 25 model 1); every method on the current code ----
specdec demo > $OUT/demo-zen3-s23.txt 2>&1   # after the one-pass GGUF header reader and the least-time bounds
TD=$(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m'))")
D=src/specdec/zoo/data/smollm2-135m
BIN=LLAMA_CPP_BUILD_BIN   # ../shared/scripts/build-llamacpp.sh prints it
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 20 --max-new-tokens 128 \
  -k 2 4 --trees 4/2/6 --draft smollm2-135m-q4_1 --drafters eagle eagle3 medusa dflash dspark mtp retrieval lookahead \
  --block-sizes 8 --no-transformers --threads 2 --output $OUT/real-bench-bf16-zen3-s23.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --max-batch-size 16 \
  --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-zen3-s23.json
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 3 --max-new-tokens 128 \
  -k 4 --draft $D/draft --drafters eagle3 dflash retrieval early-exit=$TD --exit-layers 20 --block-sizes 8 \
  --threads 2 --output $OUT/real-bench-f32-zen3-s23.json   # with transformers' plain, assisted, prompt lookup, DFlash
specdec bench --target smollm2-135m --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 128 \
  -k 4 6 8 --draft smollm2-135m-q4_1 --no-transformers --threads 2 --output $OUT/real-bench-f32-copy-zen3-s23.json
pip install diskcache   # llama-cpp-python's source imports it
PYTHONPATH=LLAMA_CPP_PYTHON_SRC LLAMA_CPP_LIB_PATH=$BIN python -m specdec.commands.llamacpp \
  --target smollm2-135m-q4_1 --tasks sharegpt --num-prompts 6 --max-new-tokens 128 -k 4 --threads 2 \
  --json $OUT/llamacpp-q4_1-zen3-s23.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 6 --max-new-tokens 128 \
  -k 2 4 --draft smollm2-135m-q4_1 --drafters eagle3 dflash retrieval --block-sizes 8 --no-transformers --threads 1 \
  --output $OUT/real-bench-bf16-1thread-zen3-s23.json

# ---- twenty-fourth session: the same Zen 3 model (AMD EPYC family 25 model 1) ----
git worktree add /tmp/base 207d51b~1 && bash docs/measurements/dspark_draft_ab.sh   # DSpark drafting before / after
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --max-batch-size 16 \
  --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-zen3-s24.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 --requests-per-client 3 --max-tokens 64 --max-batch-size 16 \
  --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-3req-zen3-s24.json
python docs/measurements/draft_p_min.py eagle3 10 "2@-,4@-,4@0.2,4@0.3,6@0.3" $OUT/draft-p-min-eagle3-zen3-s24.json
python docs/measurements/draft_p_min.py eagle 10 "2@-,4@-,4@0.2,4@0.3,6@0.2" $OUT/draft-p-min-eagle-zen3-s24.json
python docs/measurements/draft_p_min.py q4_1 10 "4@-,4@0.1,4@0.3,6@0.2" $OUT/draft-p-min-q4_1-zen3-s24.json
specdec demo > $OUT/demo-zen3-s24.txt 2>&1   # EAGLE at its recorded k = 4 and p_min
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter eagle3 --draft $D/eagle3 --modes plain fixed \
  load-aware --concurrency 1 4 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/eagle3-serve-zen3-s24.json
python docs/measurements/draft_p_min.py draft 10 "2@-,4@-,4@0.3,4@0.5,6@0.4" $OUT/draft-p-min-draft-zen3-s24.json
for run in 1 2; do   # under load; the first run with the fixed policy too
  specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter eagle3 --draft $D/eagle3 --modes plain \
    $([ $run = 1 ] && echo fixed) load-aware --concurrency 16 64 --requests-per-client 1 --max-tokens 64 \
    --max-batch-size 16 --tasks sharegpt --threads 2 --in-process --output $OUT/eagle3-serve-load-zen3-s24-$run.json
done

# ---- twenty-fifth session: the same Zen 3 model (AMD EPYC family 25 model 1) ----
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 3 --drafters mtp --draft-p-min 0 0.2 0.3 0.5 --no-transformers --threads 2 --record \
  --output $OUT/mtp-pmin-zen3-s25.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 4 --drafters eagle eagle3 --draft-p-min 0 0.2 0.3 --no-transformers --threads 2 --record \
  --output $OUT/eagle-pmin-zen3-s25.json
git worktree add /tmp/old 85aef5e   # before DeferredObserve
for r in 1 2; do for v in old new; do
  if [ $v = old ]; then export PYTHONPATH=/tmp/old/src; else unset PYTHONPATH; fi
  for b in 1 16; do echo "== $v batch $b round $r"; python docs/measurements/plain_steps.py none,eagle,eagle3,mtp,dspark $b 4; done
done; done > $OUT/plain-steps-ab-zen3-s25.txt 2>&1
unset PYTHONPATH
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter eagle3 --draft $D/eagle3 --modes plain fixed \
  load-aware --concurrency 1 4 16 64 --requests-per-client 1 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/eagle3-serve-zen3-s25.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 --requests-per-client 3 --max-tokens 64 --max-batch-size 16 \
  --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-3req-zen3-s25.json
python docs/measurements/dspark_serve_trace.py 4 > $OUT/dspark-serve-trace-4-zen3-s25.txt 2>&1
specdec demo > $OUT/demo-zen3-s25.txt 2>&1
python docs/measurements/serve_policy_trace.py plain,load-aware 4 --drafter eagle3 --draft $D/eagle3 \
  > $OUT/eagle3-serve-trace-4-before-zen3-s25.txt 2>&1   # before LoadAware counted a drafter's own cut
python docs/measurements/serve_policy_trace.py plain,fixed,load-aware 4 --drafter eagle3 --draft $D/eagle3 \
  > $OUT/eagle3-serve-trace-4-zen3-s25.txt 2>&1
python docs/measurements/serve_policy_trace.py plain,fixed,load-aware 1 --drafter eagle3 --draft $D/eagle3 \
  > $OUT/eagle3-serve-trace-1-zen3-s25.txt 2>&1
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 --drafters eagle3 --draft-p-min 0.2 --policies load-aware --no-transformers --threads 2 \
  --output $OUT/eagle3-loadaware-bench-zen3-s25.json   # after LoadAware.verified_seconds

# ---- twenty-sixth session: the same Zen 3 model (AMD EPYC family 25 model 1) ----
# ShareGPT's greedy answers (the datastore's, committed) and the target's answers to 1,024 code requests; features
echo '{"source": "sharegpt-answers", "train_sequences": 2048, "code_requests": 1024, "prefix_len": 256, "generated_len": 192}' > code.json
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --config code.json --data-dir runs/data \
  --out runs/s26/data/out --ckpt-dir runs/s26/data/ckpt --threads 2 --max-minutes 0
# EAGLE-1 (kept) and EAGLE-3 (not kept: the committed folder stays) continued on it, each then benched beside the
# committed folder; EAGLE-1's fastest row then recorded (bench.record_fastest) and copied into $D/eagle
for run in "eagle:eagle1:head_vocab:8192:1000:4e-4:20:500:28:4:0.3" "eagle3:eagle3:ttt_steps:3:100:2e-4:5:100:32:2:0.2"; do
  IFS=: read m name field value steps lr warmup every minutes k p <<< "$run"
  echo "{\"source\": \"sharegpt-answers\", \"train_sequences\": 2048, \"code_requests\": 1024, \"prefix_len\": 256,
   \"generated_len\": 192, \"$field\": $value, \"optim\": {\"steps\": $steps, \"lr\": $lr, \"warmup_steps\": $warmup,
   \"eval_every\": $every}}" > $name.json
  specdec train $m --target smollm2-135m --preset $m-sharegpt-self --config $name.json --init-from $D/$m \
    --data-dir runs/data --out runs/s26/$m/out --ckpt-dir runs/s26/$m/ckpt --threads 2 --max-minutes $minutes
  specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
    -k $k --draft-p-min 0 $p --drafters $m=runs/s26/$m/out $m=$D/$m --no-transformers --threads 2 \
    --output $OUT/$m-code-zen3-s26.json
done
for r in a b; do
  specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dspark@confidence \
    --concurrency 1 4 16 64 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt --threads 2 \
    --in-process --output $OUT/dspark-serve-zen3-s26$r.json
done
specdec demo > $OUT/demo-zen3-s26.txt 2>&1

# ---- twenty-seventh session: AMD EPYC family 25 model 17 (Zen 4: avx512f/bw/vl, avx512_bf16, avx512_vnni; no AMX) ----
BIN=$(bash ../shared/scripts/build-llamacpp.sh)
python docs/measurements/cost_curves.py --llama-bench $BIN --threads 1 2 --output $OUT/cost-curves-zen4-s27.json
python docs/measurements/cost_curves.py --threads 2 --output $OUT/cost-curves-zen4-s27b.json   # an hour later, specdec only
# plain decoding and prompt lookup beside llama.cpp on four files (F32, BF16, Q8_0 exported; Q4_1 the shipped one);
# llama-cpp-python without its own build, on the libraries built above
CMAKE_ARGS="-DLLAMA_BUILD=OFF" pip install llama-cpp-python==0.3.36
Q41=$(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m-q4_1'))")
F32=$(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m'))")
for w in f32 bf16 q8_0; do python -m specdec.commands.gguf $F32 /tmp/smollm2-$w.gguf --dtype $w; done
for w in q4_1 q8_0 bf16 f32; do
  case $w in q4_1) F=$Q41/model.gguf;; *) F=/tmp/smollm2-$w.gguf;; esac
  LLAMA_CPP_LIB_PATH=$BIN python -m specdec.commands.llamacpp --target $F --gguf $F --tasks sharegpt --num-prompts 4 \
    --max-new-tokens 96 -k 4 --threads 2 --json $OUT/llamacpp-$w-zen4-s27.json
done
# products alone per build of kernels.c (the row-loop unrolling and 8-row Q8_0 blocks tried; not kept)
MODEL=/tmp/smollm2-q8_0.gguf python docs/measurements/products_variants.py 2 float32 1,4,8,12,16,17,32 A.c U.c UC.c
python docs/measurements/products_variants.py 2 bfloat16 1,8,16 A.c P2k.c P8k.c PT0.c   # prefetch 2/8 KiB, into L1
# the twenty-sixth session's data again (the machine was new), then EAGLE-3 continued on it
echo '{"source": "sharegpt-answers", "train_sequences": 2048, "code_requests": 1024, "prefix_len": 256, "generated_len": 192}' > code.json
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --config code.json --data-dir runs/data \
  --out runs/s27/data/out --ckpt-dir runs/s27/data/ckpt --threads 2 --max-minutes 0
echo '{"source": "sharegpt-answers", "train_sequences": 2048, "code_requests": 1024, "prefix_len": 256,
 "generated_len": 192, "ttt_steps": 3, "optim": {"steps": 900, "lr": 4e-4, "warmup_steps": 20, "eval_every": 300}}' > eagle3.json
specdec train eagle3 --target smollm2-135m --preset eagle3-sharegpt-self --config eagle3.json --init-from $D/eagle3 \
  --data-dir runs/data --out runs/s27/eagle3/out --ckpt-dir runs/s27/eagle3/ckpt --threads 2 --max-minutes 55
#   (stopped at step 40 for the kernel runs above, then:)
specdec train eagle3 --target smollm2-135m --data-dir runs/data --out runs/s27/eagle3/out --ckpt-dir runs/s27/eagle3/ckpt \
  --threads 2 --resume --max-minutes 50
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 3 --draft-p-min 0 0.2 --drafters eagle3=runs/s27/eagle3/out eagle3=$D/eagle3 --no-transformers --threads 2 \
  --output $OUT/eagle3-code-zen4-s27.json
python -c "import json; from specdec.commands.bench import record_fastest; record_fastest(json.load(open('$OUT/eagle3-code-zen4-s27.json')), 'eagle3', 'runs/s27/eagle3/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True)"
cp runs/s27/eagle3/out/{config.json,model.safetensors,training_summary.json} $D/eagle3/
specdec demo > $OUT/demo-zen4-s27.txt 2>&1

# ---- twenty-eighth session: AMD EPYC family 25 model 17 (Zen 4: avx512f/bw/vl, avx512_bf16, avx512_vnni; no AMX) ----
# The twenty-sixth session's data (ShareGPT greedy answers + the target's answers to 1,024 code requests) and its
# 4-layer feature cache, rebuilt (on a new machine) without training anything:
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --config code.json --data-dir runs/data \
  --out runs/s28/data --threads 2 --data-only
# DFlash and DSpark continued on it with equal planned budgets (2.95 and 3.47 s a step measured here: 500 and 430
# steps, about 25 minutes each)
mkdir -p runs/s28/old && for m in dflash dspark; do cp -r $D/$m runs/s28/old/$m; done
for run in dflash:500:15 dspark:430:10; do IFS=: read m steps warmup <<< "$run"
  echo "{\"source\": \"sharegpt-answers\", \"train_sequences\": 2048, \"code_requests\": 1024, \"prefix_len\": 256,
   \"generated_len\": 192, \"optim\": {\"steps\": $steps, \"lr\": 6e-4, \"warmup_steps\": $warmup, \"eval_every\": $steps}}" > $m.json
  specdec train $m --target smollm2-135m --preset $m-sharegpt --config $m.json --init-from $D/$m --data-dir runs/data \
    --out runs/s28/$m/out --ckpt-dir runs/s28/$m/ckpt --threads 2 --max-minutes 30
done
O=runs/s28
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --drafters dflash=$O/dflash/out dflash=$O/old/dflash dspark=$O/dspark/out dspark=$O/old/dspark eagle3 \
  --no-transformers --threads 2 --output $OUT/block-code-zen4-s28.json
python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/block-code-zen4-s28.json'));
[record_fastest(r, m, f'runs/s28/{m}/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True) for m in ('dflash', 'dspark')]"
for m in dflash dspark; do cp runs/s28/$m/out/{config.json,model.safetensors,training_summary.json,draft_vocab.json} $D/$m/; done
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --temperature 0.7 --drafters dflash dspark eagle3 --no-transformers --threads 2 --output $OUT/block-t07-zen4-s28.json
python docs/measurements/scheduler_steps.py 2   # the scheduler's cuts and steps at one row, before and after the patience change
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed \
  dspark@conf-min:0.3 dspark@confidence --concurrency 1 4 16 64 --requests-per-client 2 --max-tokens 64 \
  --max-batch-size 16 --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-zen4-s28.json
# MTP continued on the same data (--init-from, new), then benched beside the committed module; its fastest row
# recorded (the rows of the new folder: bench labelled both folders "mtp #n" then) and copied into $D/mtp.
# mtp_round SESSION STEPS MINUTES: one such round (the twenty-ninth session ran it again)
mtp_round() {
  echo "{\"source\": \"sharegpt-answers\", \"train_sequences\": 2048, \"code_requests\": 1024, \"prefix_len\": 256,
   \"generated_len\": 192, \"optim\": {\"steps\": $2, \"lr\": 1e-3, \"warmup_steps\": 20, \"eval_every\": $(($2 / 2))}}" > mtp.json
  specdec train mtp --target smollm2-135m --config mtp.json --init-from $D/mtp --data-dir runs/data \
    --out runs/$1/mtp/out --ckpt-dir runs/$1/mtp/ckpt --threads 2 --max-minutes $3
  specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
    -k 2 3 --draft-p-min 0 0.3 --drafters mtp=runs/$1/mtp/out mtp=$D/mtp --no-transformers --threads 2 \
    --output $OUT/mtp-code-zen4-$1.json
  python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/mtp-code-zen4-$1.json'));
record_fastest(r, 'mtp', 'runs/$1/mtp/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True)"
  cp runs/$1/mtp/out/{config.json,model.safetensors,training_summary.json,draft_vocab.json} $D/mtp/
}
mtp_round s28 300 28
specdec demo > $OUT/demo-zen4-s28.txt 2>&1
python docs/measurements/dspark_serve_trace.py 1 > $OUT/dspark-serve-trace-1-zen4-s28.txt 2>&1

# ---- twenty-ninth session: AMD EPYC family 25 model 17 (Zen 4: avx512f/bw/vl, avx512_bf16, avx512_vnni; no AMX) ----
# Kernels (issue 23). OLD: the session's first kernels.c (e626029) with a stub of the function the new kernels.py
# declares, built beside the current one; both builds on each model, both load orders.
git show e626029:src/specdec/models/kernels.c > /tmp/old.c && echo 'int sd_bf16_pairs(long K) { return sd_amx_pairs(K); }' >> /tmp/old.c
OLD=$(python -c "from pathlib import Path; from specdec.models import kernels; kernels.SOURCE = Path('/tmp/old.c'); print(kernels.build())")
F=$HOME/.cache/specdec/models/smollm2-135m; Q41=$F-q4_1/model.gguf; Q8=$(ls $HOME/.cache/specdec/gguf/smollm2-q8_0-*/model.gguf | head -1)
for th in 2 1; do for spec in "$F float32" "$F bfloat16" "$Q8 float32" "$Q41 float32"; do for o in old,new new,old; do
  set -- $spec; ORDER=$o python docs/measurements/builds_ab.py $OLD $1 $2 $th 1,2,4,5,8,16,17,32,64 10
done; done; done   # measured at 77aa482 (before sd_decoder_layers, which the old build lacks)  -> kernels-ab-zen4-s29.txt
python docs/measurements/products_variants.py 2 bfloat16 1,8,16 P0.c   # P0.c: kernels.c with sd_bf16_pairs returning 0
python docs/measurements/products_variants.py 2 bfloat16 1,8,16 kernels.c   # alternated, four rounds each
BIN=$(bash ../shared/scripts/build-llamacpp.sh)
python docs/measurements/cost_curves.py --llama-bench $BIN --threads 1 2 --output $OUT/cost-curves-zen4-s29.json
python docs/measurements/layers_one_call.py $Q41 float32 2; python docs/measurements/layers_one_call.py $F bfloat16 2
for w in q4_1 q8_0 bf16 f32; do   # the files exported in the twenty-seventh block
  case $w in q4_1) F=$Q41;; *) F=/tmp/smollm2-$w.gguf;; esac
  LLAMA_CPP_LIB_PATH=$BIN python -m specdec.commands.llamacpp --target $F --gguf $F --tasks sharegpt --num-prompts 4 \
    --max-new-tokens 96 -k 4 --threads 2 --json $OUT/llamacpp-$w-zen4-s29.json
done
specdec demo > $OUT/demo-zen4-s29.txt 2>&1; specdec demo > $OUT/demo-zen4-s29b.txt 2>&1
python docs/measurements/engine_steps.py bfloat16
# MTP continued once more on the same data (the twenty-eighth block's mtp_round)
mtp_round s29 340 29
# the zoo target's float32 speed: the old kernels.c with sd_bf16_pairs and sd_decoder_layers appended, both orders
python - <<'PY' > /tmp/old3.c
from pathlib import Path
s = Path("src/specdec/models/kernels.c").read_text(); i = s.index("int sd_decoder_layers("); j = s.index("\n}\n", i) + 3
print(Path("/tmp/old.c").read_text() + "\n" + s[i:j])
PY
OLD3=$(python -c "from pathlib import Path; from specdec.models import kernels; kernels.SOURCE = Path('/tmp/old3.c'); print(kernels.build())")
Z=src/specdec/zoo/data/target
for o in old,new new,old; do ORDER=$o python docs/measurements/builds_ab.py $OLD3 $Z float32 2 1,2,4,5,8,16 30; done
python docs/measurements/layers_one_call.py $Z float32 2

# ---- thirtieth session: the same Zen 4 model (AMD EPYC family 25 model 17; avx512f/bw/vl, avx512_bf16, avx512_vnni) ----
# DSpark's greedy chain in one kernel call; DFlash and DSpark at every block size, the fastest recorded
python docs/measurements/drafting_parts.py dspark 7   # per-call medians of the drafting step's parts
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --block-sizes 2 3 4 7 --drafters dflash dspark --no-transformers --threads 2 --record --output $OUT/block-sizes-zen4-s30.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --block-sizes 2 4 7 --drafters dflash dspark --policies confidence --no-transformers --threads 2 \
  --output $OUT/block-sizes-zen4-s30b.json   # a second run, after the scheduler's patience change
# drafter networks quantized at load (--draft-quantize), interleaved with their bfloat16 selves
for m in "dflash 3" "dspark 2" "eagle3 3"; do python docs/measurements/draft_quantize_ab.py $m q8_0; done
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed \
  dspark@conf-min:0.3 dspark@confidence --concurrency 1 4 16 64 --requests-per-client 2 --max-tokens 64 \
  --max-batch-size 16 --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-zen4-s30.json
specdec demo > $OUT/demo-zen4-s30.txt 2>&1
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --temperature 0.7 --drafters dflash dspark eagle3 --no-transformers --threads 2 --output $OUT/block-t07-zen4-s30.json

# ---- thirty-first session: the same Zen 4 model (AMD EPYC family 25 model 17; avx512f/bw/vl, avx512_bf16, avx512_vnni) ----
# a staged draft model: the Q4_1 file checks prompt lookup's or retrieval's guesses several a pass
python docs/measurements/staged_passes.py 3 8 3 > $OUT/staged-passes-zen4-s31.txt
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --draft smollm2-135m-q4_1 -k 4 6 8 10 --draft-staged none prompt-lookup retrieval --drafters retrieval \
  --no-transformers --threads 2 --output $OUT/staged-g4-zen4-s31.json   # G = 4, the default then
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --draft smollm2-135m-q4_1 -k 6 8 10 --draft-staged none prompt-lookup retrieval --staged-guesses 3 \
  --no-transformers --threads 2 --output $OUT/staged-zen4-s31.json
specdec demo > $OUT/demo-zen4-s31.txt 2>&1
# EAGLE-3 continued on the faster trainer (the target's choices cached beside the features)
cat > runs/s31/eagle3.json <<'JSON'
{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256,
 "generated_len": 192, "ttt_steps": 3, "optim": {"steps": 760, "lr": 3e-4, "warmup_steps": 20, "eval_every": 250}}
JSON
specdec train eagle3 --target smollm2-135m --preset eagle3-sharegpt-self --config runs/s31/eagle3.json --init-from $D/eagle3 \
  --data-dir runs/data --out runs/s31/eagle3/out --ckpt-dir runs/s31/eagle3/ckpt --threads 2 --max-minutes 42
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 3 --draft-p-min 0 0.2 --drafters eagle3=runs/s31/eagle3/out eagle3=$D/eagle3 --no-transformers --threads 2 \
  --output $OUT/eagle3-s31-zen4.json
python -c "import json; from specdec.commands.bench import record_fastest; record_fastest(json.load(open('$OUT/eagle3-s31-zen4.json')), 'eagle3', 'runs/s31/eagle3/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True)"
cp runs/s31/eagle3/out/{config.json,model.safetensors,training_summary.json} $D/eagle3/
specdec demo > $OUT/demo-zen4-s31b.txt 2>&1   # again, with the continued EAGLE-3
specdec bench --target smollm2-135m --dtype float32 --tasks sharegpt humaneval --num-prompts 6 --max-new-tokens 128 \
  --draft smollm2-135m-q4_1 -k 8 10 --draft-staged none prompt-lookup retrieval --no-transformers --threads 2 \
  --output $OUT/staged-f32-zen4-s31.json   # a float32 target

# ---- thirty-second session: the same Zen 4 model (AMD EPYC family 25 model 17; avx512f/bw/vl, avx512_bf16, avx512_vnni) ----
python docs/measurements/draft_head_ab.py bfloat16 4 8 Q4_1 > $OUT/draft-head-ab-zen4-s32.txt   # the copy's head as Q4_1
# DFlash and DSpark continued over their draft vocabulary, the same data and budget (DFlash's steps cheaper)
mkdir -p runs/s32
for run in dflash:1800 dspark:900; do IFS=: read m steps <<< "$run"
  echo "{\"source\": \"sharegpt-answers\", \"train_sequences\": 3072, \"code_requests\": 1024, \"prefix_len\": 256,
   \"generated_len\": 192, \"optim\": {\"steps\": $steps, \"lr\": 4e-4, \"warmup_steps\": 20, \"eval_every\": 600}}" > runs/s32/$m.json
  specdec train $m --target smollm2-135m --preset $m-sharegpt --config runs/s32/$m.json --init-from $D/$m --data-dir runs/data \
    --out runs/s32/$m/out --ckpt-dir runs/s32/$m/ckpt --threads 2 --max-minutes 27
done
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --block-sizes 2 4 7 8 --drafters dflash=runs/s32/dflash/out dflash=$D/dflash dspark=runs/s32/dspark/out dspark=$D/dspark \
  --no-transformers --threads 2 --output $OUT/block-s32-zen4.json
python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/block-s32-zen4.json')); [record_fastest(r, m, f'runs/s32/{m}/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True) for m in ('dflash', 'dspark')]"
for m in dflash dspark; do cp runs/s32/$m/out/{config.json,model.safetensors,training_summary.json,draft_vocab.json} $D/$m/; done
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --temperature 0.7 --block-sizes 7 8 --drafters dflash dspark --no-transformers --threads 2 --output $OUT/block-t07-s32-zen4.json
specdec demo > $OUT/demo-zen4-s32.txt 2>&1
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed \
  dspark@conf-min:0.3 dspark@confidence --concurrency 1 4 16 64 --requests-per-client 2 --max-tokens 64 \
  --max-batch-size 16 --tasks sharegpt --threads 2 --in-process --output $OUT/dspark-serve-zen4-s32.json

# ---- thirty-third session: the same Zen 4 model (AMD EPYC family 25 model 17; avx512f/bw/vl, avx512_bf16, avx512_vnni) ----
# Medusa over an 8,192-row draft vocabulary on the target's answers (new preset), then MTP continued over its
# folder's draft vocabulary on the same cache (the final layer's features: 2.0 GB, 22 min, and the choices 4.5 min)
mkdir -p runs/s33
specdec train medusa --target smollm2-135m --preset medusa-answers --data-dir runs/data --out runs/s33/medusa/out \
  --ckpt-dir runs/s33/medusa/ckpt --threads 2 --max-minutes 40
echo '{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256, "generated_len": 192,
 "optim": {"steps": 600, "lr": 1e-3, "warmup_steps": 20, "eval_every": 300, "bfloat16": true}}' > runs/s33/mtp.json
specdec train mtp --target smollm2-135m --preset mtp-sharegpt --config runs/s33/mtp.json --init-from $D/mtp \
  --data-dir runs/data --out runs/s33/mtp/out --ckpt-dir runs/s33/mtp/ckpt --threads 2 --max-minutes 22
echo '{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256, "generated_len": 192,
 "optim": {"steps": 900, "lr": 8e-4, "warmup_steps": 20, "eval_every": 450, "bfloat16": true}}' > runs/s33/mtp2.json
specdec train mtp --target smollm2-135m --preset mtp-sharegpt --config runs/s33/mtp2.json --init-from runs/s33/mtp/out \
  --data-dir runs/data --out runs/s33/mtp2/out --ckpt-dir runs/s33/mtp2/ckpt --threads 2 --max-minutes 16
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 3 --draft-p-min 0 0.3 --drafters medusa=runs/s33/medusa/out medusa=$D/medusa mtp=runs/s33/mtp2/out mtp=$D/mtp \
  --no-transformers --threads 2 --output $OUT/medusa-mtp-s33-zen4.json
python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/medusa-mtp-s33-zen4.json'));
on = 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16';
record_fastest(r, 'mtp', 'runs/s33/mtp2/out', on, several=True); record_fastest(r, 'medusa', 'runs/s33/medusa/out', on)"
cp runs/s33/medusa/out/{config.json,medusa_lm_head.safetensors,training_summary.json,draft_vocab.json} $D/medusa/
cp runs/s33/mtp2/out/{config.json,model.safetensors,training_summary.json,draft_vocab.json} $D/mtp/
git show 18fc905:src/specdec/models/kernels.c > /tmp/old33.c   # the session's first kernels.c
OLD=$(python -c "from pathlib import Path; from specdec.models import kernels; kernels.SOURCE = Path('/tmp/old33.c'); print(kernels.build())")
for o in old,new new,old; do ORDER=$o python docs/measurements/builds_ab.py $OLD smollm2-135m-q4_1 float32 2 1,16 10; done \
  > $OUT/kernels-ab-vnni-zen4-s33.txt
python docs/measurements/dspark_serve_trace.py 64 > $OUT/dspark-serve-trace-64-zen4-s33.txt 2>&1
specdec demo > $OUT/demo-zen4-s33.txt 2>&1

# ---- thirty-fourth session: the same Zen 4 model (AMD EPYC family 25 model 17; avx512f/bw/vl, avx512_bf16, avx512_vnni) ----
# The serving trace at 64 clients before and after the departures change (run at a4a9281^ and at a4a9281)
python docs/measurements/dspark_serve_trace.py 64 > $OUT/dspark-serve-trace-64-zen4-s34.txt 2>&1
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@conf-min:0.3 \
  dspark@confidence --concurrency 1 4 16 64 --requests-per-client 3 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-zen4-s34.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@fixed \
  dspark@confidence --concurrency 1 --requests-per-client 10 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-1-client-zen4-s34.json
# MTP continued from the committed module on the answers cache (the final layer's features, as in the 33rd block)
mkdir -p runs/s34
echo '{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256, "generated_len": 192,
 "optim": {"steps": 1200, "lr": 6e-4, "warmup_steps": 20, "eval_every": 600, "bfloat16": true}}' > runs/s34/mtp.json
specdec train mtp --target smollm2-135m --preset mtp-sharegpt --config runs/s34/mtp.json --init-from $D/mtp \
  --data-dir runs/data --out runs/s34/mtp/out --ckpt-dir runs/s34/mtp/ckpt --threads 2 --max-minutes 24
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 2 3 --draft-p-min 0 0.3 --drafters mtp=runs/s34/mtp/out mtp=$D/mtp --no-transformers --threads 2 \
  --output $OUT/mtp-s34-zen4.json
python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/mtp-s34-zen4.json'));
record_fastest(r, 'mtp', 'runs/s34/mtp/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True)"
cp runs/s34/mtp/out/{config.json,model.safetensors,training_summary.json,draft_vocab.json} $D/mtp/
# The Q4_1 file drafting over DFlash's 8,192-token vocabulary (a copy of its folder with draft_vocab.json), beside the whole head
mkdir -p runs/s34/q41dv && cp -a ~/.cache/specdec/models/smollm2-135m-q4_1/. runs/s34/q41dv/ && cp $D/dflash/draft_vocab.json runs/s34/q41dv/
for d in smollm2-135m-q4_1 runs/s34/q41dv; do
  specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
    --draft $d -k 8 --draft-staged prompt-lookup --staged-guesses 3 --no-transformers --threads 2 --output $OUT/staged-$(basename $d).json
done
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 1 2 --trees 2/2/3 2/3/4 3/2/5 --drafters medusa=$D/medusa --no-transformers --threads 2 --output $OUT/medusa-s34-zen4.json
specdec demo > $OUT/demo-zen4-s34.txt 2>&1
# bench-serve in paired rounds (after the departures change and the cut on Python floats)
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@confidence \
  --concurrency 1 4 16 64 --rounds 3 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-rounds-zen4-s34.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@confidence \
  --concurrency 1 4 --rounds 3 --requests-per-client 6 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-rounds-1-4-zen4-s34.json
python docs/measurements/dspark_serve_trace.py 4 > $OUT/dspark-serve-trace-4-zen4-s34.txt 2>&1
# (the catch-up and best-k variants, reverted, gave dspark-serve-rounds-{1-4-,}catch-up-zen4-s34.json with the same commands)
git show 834a6c0:src/specdec/models/kernels.c > /tmp/old34.c   # the one-chain VNNI tile tried against it, not kept
OLD=$(python -c "from pathlib import Path; from specdec.models import kernels; kernels.SOURCE = Path('/tmp/old34.c'); print(kernels.build())")
for o in old,new new,old; do ORDER=$o python docs/measurements/builds_ab.py $OLD smollm2-135m-q4_1 float32 2 1,4,8,16,32 10; done
python docs/measurements/cost_curves.py --threads 2 --output $OUT/cost-curves-zen4-s34.json
# (the prompt entered at admission, reverted: the same paired command -> dspark-serve-rounds-prompt-entered-zen4-s34.json)
# EAGLE-1 continued twice on the answers cache (final layer's features), then beside the committed folder
echo '{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256, "generated_len": 192, "head_vocab": 8192,
 "optim": {"steps": 700, "lr": 6e-4, "warmup_steps": 20, "eval_every": 350, "bfloat16": true}}' > runs/s34/eagle.json
specdec train eagle --target smollm2-135m --preset eagle-sharegpt-self --config runs/s34/eagle.json --init-from $D/eagle \
  --data-dir runs/data --out runs/s34/eagle/out --ckpt-dir runs/s34/eagle/ckpt --threads 2 --max-minutes 23
sed 's/6e-4/3e-4/' runs/s34/eagle.json > runs/s34/eagle2.json
specdec train eagle --target smollm2-135m --preset eagle-sharegpt-self --config runs/s34/eagle2.json --init-from runs/s34/eagle/out \
  --data-dir runs/data --out runs/s34/eagle2/out --ckpt-dir runs/s34/eagle2/ckpt --threads 2 --max-minutes 14
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 3 4 --draft-p-min 0 0.3 --drafters eagle=runs/s34/eagle2/out eagle=$D/eagle --no-transformers --threads 2 \
  --output $OUT/eagle-s34-zen4.json
python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/eagle-s34-zen4.json'));
record_fastest(r, 'eagle', 'runs/s34/eagle2/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True)"
cp runs/s34/eagle2/out/{config.json,model.safetensors,training_summary.json} $D/eagle/

# ---- thirty-fifth session: the same Zen 4 model (AMD EPYC family 25 model 17; avx512f/bw/vl, avx512_bf16, avx512_vnni) ----
# The answers data's 4-layer feature cache, rebuilt without training (20 min of features, 4 of choices)
mkdir -p runs/s35
echo '{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256, "generated_len": 192}' > runs/s35/data.json
specdec train dflash --target smollm2-135m --preset dflash-sharegpt --config runs/s35/data.json --data-dir runs/data \
  --out runs/s35/data --threads 2 --data-only
# DSpark, then DFlash, continued over their draft vocabularies for about 19 minutes each (DSpark's first run also
# writes the target's log-normalizers beside the features, 7 min once)
for run in dspark:1200 dflash:1600; do IFS=: read m steps <<< "$run"
  echo "{\"source\": \"sharegpt-answers\", \"train_sequences\": 3072, \"code_requests\": 1024, \"prefix_len\": 256,
   \"generated_len\": 192, \"optim\": {\"steps\": $steps, \"lr\": 3e-4, \"warmup_steps\": 20, \"eval_every\": $((steps/2))}}" > runs/s35/$m.json
  specdec train $m --target smollm2-135m --preset $m-sharegpt --config runs/s35/$m.json --init-from $D/$m --data-dir runs/data \
    --out runs/s35/$m/out --ckpt-dir runs/s35/$m/ckpt --threads 2 --max-minutes 24
done
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --block-sizes 2 4 7 8 --drafters dflash=runs/s35/dflash/out dflash=$D/dflash dspark=runs/s35/dspark/out dspark=$D/dspark \
  eagle3 --no-transformers --threads 2 --output $OUT/block-s35-zen4.json
python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/block-s35-zen4.json')); [record_fastest(r, m, f'runs/s35/{m}/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True) for m in ('dflash', 'dspark')]"
for m in dflash dspark; do cp runs/s35/$m/out/{config.json,model.safetensors,training_summary.json,draft_vocab.json} $D/$m/; done
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --temperature 0.7 --block-sizes 7 8 --drafters dflash dspark --no-transformers --threads 2 --output $OUT/block-t07-s35-zen4.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@confidence \
  --concurrency 1 4 16 64 --rounds 3 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-rounds-zen4-s35.json
specdec demo > $OUT/demo-zen4-s35.txt 2>&1
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@confidence \
  --concurrency 1 4 --rounds 3 --requests-per-client 6 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-rounds-1-4-zen4-s35.json
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dspark@confidence -k 4 \
  --concurrency 1 4 --rounds 3 --requests-per-client 6 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output runs/s35/serve-k4.json   # the scheduler allowed 4 drafts: not kept
# EAGLE-1 continued once more on the answers cache (final layer's features), then beside the committed folder
echo '{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256, "generated_len": 192, "head_vocab": 8192,
 "optim": {"steps": 700, "lr": 2e-4, "warmup_steps": 20, "eval_every": 350, "bfloat16": true}}' > runs/s35/eagle.json
specdec train eagle --target smollm2-135m --preset eagle-sharegpt-self --config runs/s35/eagle.json --init-from $D/eagle \
  --data-dir runs/data --out runs/s35/eagle/out --ckpt-dir runs/s35/eagle/ckpt --threads 2 --max-minutes 14
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 3 4 --drafters eagle=runs/s35/eagle/out eagle=$D/eagle --no-transformers --threads 2 --output $OUT/eagle-s35-zen4.json
python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/eagle-s35-zen4.json'));
record_fastest(r, 'eagle', 'runs/s35/eagle/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True)"
cp runs/s35/eagle/out/{config.json,model.safetensors,training_summary.json} $D/eagle/
# ---- thirty-sixth session (Zen 4) ----
# EAGLE-3 continued on the 4-layer answers cache, then beside the committed folder (not kept: no gain)
mkdir -p runs/s36
echo '{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256, "generated_len": 192,
 "ttt_steps": 3, "optim": {"steps": 420, "lr": 2e-4, "warmup_steps": 20, "eval_every": 210}}' > runs/s36/eagle3.json
specdec train eagle3 --target smollm2-135m --preset eagle3-sharegpt-self --config runs/s36/eagle3.json --init-from $D/eagle3 \
  --data-dir runs/data --out runs/s36/eagle3/out --ckpt-dir runs/s36/eagle3/ckpt --threads 2 --max-minutes 40
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  -k 3 --draft-p-min 0 0.2 --drafters eagle3=runs/s36/eagle3/out eagle3=$D/eagle3 --no-transformers --threads 2 \
  --output $OUT/eagle3-s36-zen4.json
# Where a staged pass goes: in a checkout of 5f2efff (git worktree add /tmp/old 5f2efff; cd /tmp/old; PYTHONPATH=src
# python <this repo>/docs/measurements/staged_pass_parts.py), then here; twice each, appended
python docs/measurements/staged_pass_parts.py > $OUT/staged-pass-parts-zen4-s36.txt
# Staged variants beside the modules of 5f2efff (the commit before the staged loop and lookups changed)
python docs/measurements/staged_variants.py 6 64 "old G3,G3,G2,G4,G3 n>=2,G3 p0.2,old R3,R3" 5f2efff \
  > $OUT/staged-variants-zen4-s36.txt
# DSpark continued once more, then beside the committed folder and DFlash's
echo '{"source": "sharegpt-answers", "train_sequences": 3072, "code_requests": 1024, "prefix_len": 256, "generated_len": 192,
 "optim": {"steps": 1200, "lr": 2e-4, "warmup_steps": 20, "eval_every": 600}}' > runs/s36/dspark.json
specdec train dspark --target smollm2-135m --preset dspark-sharegpt --config runs/s36/dspark.json --init-from $D/dspark \
  --data-dir runs/data --out runs/s36/dspark/out --ckpt-dir runs/s36/dspark/ckpt --threads 2 --max-minutes 24
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --block-sizes 2 7 --drafters dspark=runs/s36/dspark/out dspark=$D/dspark dflash --no-transformers --threads 2 \
  --output $OUT/block-s36-zen4.json
python -c "import json; from specdec.commands.bench import record_fastest; r = json.load(open('$OUT/block-s36-zen4.json'));
record_fastest(r, 'dspark', 'runs/s36/dspark/out', 'sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16', several=True)"
cp runs/s36/dspark/out/{config.json,model.safetensors,training_summary.json,draft_vocab.json} $D/dspark/
specdec demo > $OUT/demo-zen4-s36.txt 2>&1
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@confidence \
  --concurrency 1 4 16 64 --rounds 3 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-rounds-zen4-s36.json

# ---- Thirty-seventh session (Zen 4, AMD EPYC family 25 model 17) ----
# The Q4_1 file staged on prompt lookup against retrieval, twice (the second records the fastest in the file's folder)
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --draft smollm2-135m-q4_1 -k 8 10 --draft-staged prompt-lookup retrieval --no-transformers --threads 2 \
  --json --output $OUT/staged-retrieval-zen4-s37.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
  --draft smollm2-135m-q4_1 -k 8 10 12 --draft-staged prompt-lookup retrieval --no-transformers --threads 2 --record \
  --output $OUT/staged-retrieval-k-zen4-s37.json
# Guesses a pass, staged on retrieval at k = 10
for g in 3 4 5; do
  specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 10 --max-new-tokens 128 \
    --draft smollm2-135m-q4_1 -k 10 --draft-staged retrieval --staged-guesses $g --no-transformers --threads 2 \
    --output $OUT/staged-retrieval-g$g-zen4-s37.json
done
# Over the demo's length
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 2 --max-new-tokens 64 \
  --draft smollm2-135m-q4_1 -k 8 10 --draft-staged prompt-lookup retrieval --no-transformers --threads 2 --repeats 3 \
  --output $OUT/staged-retrieval-64-zen4-s37.json
# For a float32 target
specdec bench --target smollm2-135m --dtype float32 --tasks sharegpt humaneval --num-prompts 6 --max-new-tokens 128 \
  --draft smollm2-135m-q4_1 -k 8 10 --draft-staged prompt-lookup retrieval --no-transformers --threads 2 \
  --output $OUT/staged-retrieval-f32-zen4-s37.json
# A Q4_1 head rescored at its top 4 / 16 (not kept)
python docs/measurements/draft_head_rescore.py bfloat16 3 8 4,16 > $OUT/draft-head-rescore-zen4-s37.txt
# The demo: two runs of one pass a prompt (before --repeats), then with each prompt run twice
specdec demo --repeats 1 > $OUT/demo-zen4-s37a.txt 2>&1
specdec demo --repeats 1 > $OUT/demo-zen4-s37b.txt 2>&1
specdec demo > $OUT/demo-zen4-s37c.txt 2>&1
# Taps inside the layers' one call (three runs), then the demo again
python docs/measurements/taps_one_call.py >> $OUT/taps-one-call-zen4-s37.txt
specdec demo > $OUT/demo-zen4-s37.txt 2>&1
# Retrieval's fields for the staged copy, and a free tail (neither kept)
python docs/measurements/staged_variants.py 6 64 "R3,R3 min_score=0.3,R3 min_score=0.02,R3 samples=16,R3 samples=256,R3 context_paths=2,R3 max_ngram=8" \
  > $OUT/staged-retrieval-variants-zen4-s37.txt
python docs/measurements/staged_tail_ab.py 6 64 6,8 > $OUT/staged-tail-ab-zen4-s37.txt
# Served again, then the demo once more
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@confidence \
  --concurrency 1 4 16 64 --rounds 3 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-rounds-zen4-s37.json
specdec demo > $OUT/demo-zen4-s37d.txt 2>&1
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed dspark@confidence \
  --concurrency 1 4 --rounds 3 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-rounds-1-4-zen4-s37.json

# --- Thirty-eighth session (the same Zen 4 model; 2 threads) ---
# Every concurrency's rounds of plain decoding, DFlash's fixed block and the DSpark scheduler, into $OUT/$1
serve_rounds() {
  specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dflash@fixed \
    dspark@confidence --concurrency 1 4 16 64 --rounds 3 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 \
    --tasks sharegpt --threads 2 --in-process --output "$OUT/$1"
}
# The scheduler's steps traced at 64 and 16 clients (where its time goes: admissions, probes, one slow step)
python docs/measurements/dspark_serve_trace.py 64
python docs/measurements/dspark_serve_trace.py 16
# A drafter's waiting context over its valid entries only, against every entry (the previous code's work)
python docs/measurements/context_entry_ab.py > $OUT/context-entry-ab-zen4-s38.txt
# Served after it, then after the attention change (OLD.so: a build of the session's first kernels.c), then after
# the compaction change
serve_rounds dspark-serve-rounds-zen4-s38.json
python docs/measurements/attention_reach_ab.py OLD.so 16 > $OUT/attention-reach-ab-zen4-s38.txt
python docs/measurements/prefill_ab.py OLD.so smollm2-135m bfloat16 48,166,500 8 > $OUT/prefill-ab-zen4-s38.txt
specdec demo > $OUT/demo-zen4-s38.txt 2>&1
serve_rounds dspark-serve-rounds-zen4-s38b.json
serve_rounds dspark-serve-rounds-zen4-s38c.json
specdec demo > $OUT/demo-zen4-s38b.txt 2>&1
# Issue 23's curves
python docs/measurements/cost_curves.py --threads 2 --output $OUT/cost-curves-zen4-s38.json

# --- Thirty-ninth session (the same Zen 4 model; 2 threads) ---
# OLD.so: a build of the session's first kernels.c; llama.cpp's tools from ../shared/scripts/build-llamacpp.sh
BIN=$(bash ../shared/scripts/build-llamacpp.sh)
python docs/measurements/cost_curves.py --llama-bench $BIN --threads 2 --output $OUT/cost-curves-zen4-s39.json
# Where a pass goes, phase by phase; attention's per-row work vectorised against the first build
python docs/measurements/layer_phases.py smollm2-135m bfloat16 1,4,9,16 > $OUT/layer-phases-zen4-s39.txt
python docs/measurements/layer_phases.py smollm2-135m-q4_1 float32 1,4,9,16 >> $OUT/layer-phases-zen4-s39.txt
python docs/measurements/attention_reach_ab.py OLD.so 30 pass > $OUT/attention-ab-shapes-zen4-s39.txt
# Weights in huge pages or not, both loading orders
for model in "smollm2-135m bfloat16" "smollm2-135m-q4_1 float32"; do
  for order in plain,huge huge,plain; do
    ORDER=$order python docs/measurements/huge_pages_ab.py $model 1,4,9,16 >> $OUT/huge-pages-ab-zen4-s39.txt
  done
done
specdec demo > $OUT/demo-zen4-s39.txt 2>&1
# The staged draft model's Python: retrieval's guesses, then the loop (each against its file's previous version)
git show 0c3efec:src/specdec/drafters/prompt_lookup.py > /tmp/old_pl.py
python docs/measurements/staged_ab.py propose /tmp/old_pl.py > $OUT/staged-propose-ab-zen4-s39.txt
git show 1663b4d:src/specdec/drafters/draft_model.py > /tmp/old_draft_model.py
python docs/measurements/staged_ab.py loop /tmp/old_draft_model.py > $OUT/staged-loop-ab-zen4-s39.txt
# The staged draft model over issue 22's prompts
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 20 --max-new-tokens 128 \
  --draft smollm2-135m-q4_1 -k 8 --draft-staged retrieval --no-transformers --threads 2 \
  --output $OUT/staged-retrieval-20x128-zen4-s39.json
# Issue 23's curves at the end, the demo twice
python docs/measurements/cost_curves.py --llama-bench $BIN --threads 2 --output $OUT/cost-curves-zen4-s39b.json
specdec demo > $OUT/demo-zen4-s39b.txt 2>&1
specdec demo > $OUT/demo-zen4-s39c.txt 2>&1

# --- Fortieth session (an AMD EPYC family 25 model 17 whose VM hides AVX-512: avx2, fma; 2 threads) ---
# The first figures on this CPU, with llama.cpp's tools built here; the demo
BIN=$(bash ../shared/scripts/build-llamacpp.sh)
specdec demo > $OUT/demo-avx2-s40.txt 2>&1
python docs/measurements/cost_curves.py --llama-bench $BIN --threads 2 --output $OUT/cost-curves-avx2-s40.json
python docs/measurements/layer_phases.py smollm2-135m-q4_1 float32 1,2,4 > $OUT/layer-phases-avx2-s40.txt
python docs/measurements/layer_phases.py smollm2-135m bfloat16 1,5,9 >> $OUT/layer-phases-avx2-s40.txt
python docs/measurements/layer_phases.py smollm2-135m bfloat16 15,16,17 >> $OUT/layer-phases-avx2-s40.txt
# (before the change)
python docs/measurements/staged_pass_parts.py 2 retrieval > $OUT/staged-pass-parts-avx2-s40.txt
# The AVX2 quantized products after the change (OLD.c: kernels.c at 13aaec5), all products of a pass interleaved
git show 13aaec5:src/specdec/models/kernels.c > /tmp/base.c
MODEL=$(python -c "from specdec.zoo import zoo_path; print(zoo_path('smollm2-135m-q4_1'))") \
  python docs/measurements/products_variants.py 2 float32 1,2,3,4,5,6,7,8,9,12,16 /tmp/base.c src/specdec/models/kernels.c \
  >> $OUT/qproducts-avx2-ab-s40.txt
specdec demo > $OUT/demo-avx2-s40b.txt 2>&1
python docs/measurements/cost_curves.py --llama-bench $BIN --threads 2 --output $OUT/cost-curves-avx2-s40b.json
# DSpark's scheduler served on this CPU
serve_rounds dspark-serve-rounds-avx2-s40.json
# The staged draft model's k on this CPU (before the AVX2 setting shipped): demo-length, then issue 22's prompts
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 \
  --draft smollm2-135m-q4_1 -k 4 6 8 --draft-staged retrieval --no-transformers --threads 2 --repeats 2 \
  --output $OUT/staged-k-avx2-s40.json
specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 20 --max-new-tokens 128 \
  --draft smollm2-135m-q4_1 -k 3 4 5 8 --draft-staged retrieval --no-transformers --threads 2 \
  --output $OUT/staged-retrieval-20x128-avx2-s40.json
# After it (the file's k = 4 here)
specdec demo > $OUT/demo-avx2-s40c.txt 2>&1
# Guesses a pass at k = 3, 4, 5 (after the change)
for g in 2 3; do
  specdec bench --target smollm2-135m --dtype bfloat16 --tasks sharegpt humaneval --num-prompts 4 --max-new-tokens 96 \
    --draft smollm2-135m-q4_1 -k 3 4 5 --draft-staged retrieval --staged-guesses $g --no-transformers --threads 2 \
    --repeats 2 --output $OUT/staged-g$g-avx2-s40.json
done
# The scheduler against plain decoding alone, at 16 and 64 clients
specdec bench-serve --target smollm2-135m --dtype bfloat16 --drafter dspark --modes plain dspark@confidence \
  --concurrency 16 64 --rounds 3 --requests-per-client 2 --max-tokens 64 --max-batch-size 16 --tasks sharegpt \
  --threads 2 --in-process --output $OUT/dspark-serve-16-64-avx2-s40.json
