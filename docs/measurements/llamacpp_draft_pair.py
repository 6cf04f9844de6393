"""The shipped Q4_1 file drafting for SmolLM2-135M in float32 and bfloat16, in llama.cpp
(llama-speculative-simple, --spec-type draft-simple) and in specdec, on the same weights (the float folder
exported by specdec's GGUF writer, the same Q4_1 file), the same held-out ShareGPT prompts, greedy, 2 threads:
decoding speed after the prompt (llama.cpp's "decoded" line; specdec's new tokens after the first over the
time after prefill), beside each one's plain decoding (llama-bench tg64; specdec without a drafter).

    python docs/measurements/llamacpp_draft_pair.py BIN_DIR NUM_PROMPTS K [MAX_NEW_TOKENS]
    BIN_DIR: where ../shared/scripts/build-llamacpp.sh put llama-speculative-simple and llama-bench
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cost_curves import export  # noqa: E402

from specdec.backends.target import load_target  # noqa: E402
from specdec.drafters.draft_model import DraftModel  # noqa: E402
from specdec.engine import generate  # noqa: E402
from specdec.models import kernels  # noqa: E402
from specdec.zoo import zoo_path  # noqa: E402
from specdec.zoo.tasks import load_tasks  # noqa: E402


def llama_decoded(binary: Path, target: Path, draft: Path | None, prompt: str, k: int, new: int) -> float:
    if draft is None:
        out = subprocess.run([str(binary / "llama-bench"), "-m", str(target), "-p", "0", "-n", str(new), "-t", "2",
                              "-r", "3", "-o", "csv"], capture_output=True, text=True, check=True).stdout
        return float(out.strip().splitlines()[-1].split(",")[-2].strip('"'))
    out = subprocess.run([str(binary / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
                          "--spec-type", "draft-simple", "-p", prompt, "-n", str(new), "-t", "2", "-td", "2",
                          "--temp", "0", "-c", "2048", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"],
                         capture_output=True, text=True, check=True)
    match = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out.stdout + out.stderr)
    return int(match.group(1)) / float(match.group(2))


def main() -> int:
    binary, count, k = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    new = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    work = Path(tempfile.mkdtemp(prefix="specdec-pair-"))
    quantized = Path(os.path.realpath(zoo_path("smollm2-135m-q4_1") / "model.gguf"))
    print(f"{kernels.cpu_summary()}, 2 threads, draft = {quantized.name}, k = {k}, {new} new tokens, {count} ShareGPT prompts")
    for dtype, kind in (("bfloat16", "bf16"), ("float32", "f32")):
        weights = export(zoo_path("smollm2-135m"), work / f"smollm2-{kind}.gguf", kind)
        target = load_target("smollm2-135m", backend="native", dtype=dtype)
        kernels.set_threads(2)
        drafter = DraftModel("smollm2-135m-q4_1")
        prompts = load_tasks("sharegpt", tokenizer=target.tokenizer)[:count]
        rates = {"llama.cpp plain": [llama_decoded(binary, weights, None, "", k, new)],
                 "llama.cpp draft": [], "specdec plain": [], "specdec draft": []}
        for prompt in prompts:
            rates["llama.cpp draft"].append(llama_decoded(binary, weights, quantized, prompt, k, new))
            ids = target.encode([prompt])
            for name, source in (("specdec plain", None), ("specdec draft", drafter)):
                best = 0.0
                for _ in range(2):
                    stats = generate(target, ids, source, num_draft_tokens=k, max_new_tokens=new).stats
                    best = max(best, (stats.new_tokens - 1) / (stats.total_time - stats.prefill_time))
                rates[name].append(best)
        mean = {name: sum(v) / len(v) for name, v in rates.items()}
        print(f"{dtype}: " + "  ".join(f"{name} {value:.1f} tok/s" for name, value in mean.items())
              + f"  | draft over plain: llama.cpp {mean['llama.cpp draft'] / mean['llama.cpp plain']:.2f}x, "
              f"specdec {mean['specdec draft'] / mean['specdec plain']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
