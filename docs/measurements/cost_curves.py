"""T(n) of the real target in every weight type specdec runs, at 1 and 2 threads, beside llama.cpp's
llama-bench on the same GGUF files when its binaries are given (issue 23's table).

    python docs/measurements/cost_curves.py [--llama-bench BIN_DIR [--llama-repack 0]] [--output FILE.json] [--threads 1 2]

Weight types: the float32 folder (smollm2-135m), the same in bfloat16, the shipped Q4_1 file as it is
(smollm2-135m-q4_1), and Q8_0 (the float32 folder exported by specdec's GGUF writer). Context 200,
n = 1, 2, 4, 5, 8, 16, 17, 32, 64; specdec: the median of 15 forward passes (backends.costs.forward_time);
llama.cpp: llama-bench -p n -d 200 (its prompt processing of n tokens after 200), 5 repetitions.
Run on an otherwise idle machine: every figure is a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from specdec.backends.costs import forward_time, machine_limit
from specdec.backends.target import load_target
from specdec.commands.bench import COST_SIZES
from specdec.commands.gguf import export
from specdec.models import kernels
from specdec.zoo import zoo_path

CONTEXT = 200


def specdec_curves(files: dict[str, Path], threads: int) -> dict:
    torch.set_num_threads(threads)
    kernels.set_threads(threads)
    out = {}
    cases = {"F32": ("smollm2-135m", "float32"), "BF16": ("smollm2-135m", "bfloat16"),
             "Q8_0": (str(files["Q8_0"]), "float32"), "Q4_1": ("smollm2-135m-q4_1", "float32")}
    for name, (model, dtype) in cases.items():
        target = load_target(model, dtype=dtype, backend="native")
        ms = {n: 1e3 * forward_time(target.backend, n, CONTEXT) for n in COST_SIZES}
        limit = machine_limit(target.backend, COST_SIZES, CONTEXT)
        out[name] = {"ms": ms, "limit_ms": {int(n): v for n, v in limit["ms"].items()},
                     "weight_mib": limit["weight_bytes"] / 2**20, "bandwidth_gb_s": limit["bandwidth_gb_s"]}
        print(f"specdec {name} {threads} thread(s): " + ", ".join(f"T({n}) {v:.1f}" for n, v in ms.items()),
              flush=True)
    return out


def llama_bench(binaries: Path, model: Path, threads: int, repack: int = 1) -> dict:
    sizes = ",".join(str(n) for n in COST_SIZES)
    command = [str(binaries / "llama-bench"), "-m", str(model), "-p", sizes, "-n", "64", "-d", str(CONTEXT),
               "-t", str(threads), "-r", "5", "-o", "json", "--repack", str(repack)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "LD_LIBRARY_PATH": str(binaries)})
    if result.returncode:
        return {"error": result.stderr.strip().splitlines()[-1:]}
    rows = json.loads(result.stdout)
    ms = {int(r["n_prompt"]): 1e3 * r["n_prompt"] / r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"]}
    generation = [r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"]]
    return {"ms": ms, "tg_tokens_per_s": generation[0] if generation else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-bench", type=Path, default=None, metavar="BIN_DIR")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--llama-repack", type=int, choices=(0, 1), default=1,
                        help="llama-bench --repack (0 where llama.cpp's AMX path crashes: built by GCC 12)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specdec-costs-"))
    folder = zoo_path("smollm2-135m")
    files = {kind.upper(): export(folder, work / f"smollm2-{kind}.gguf", kind) for kind in ("f32", "bf16", "q8_0")}
    files["Q4_1"] = Path(os.path.realpath(zoo_path("smollm2-135m-q4_1") / "model.gguf"))
    result = {"cpu": kernels.cpu_summary(), "context": CONTEXT, "specdec": {}, "llama.cpp": {}}
    for threads in args.threads:
        result["specdec"][threads] = specdec_curves(files, threads)
        if args.llama_bench:
            result["llama.cpp"][threads] = {name: llama_bench(args.llama_bench, path, threads, args.llama_repack)
                                            for name, path in files.items()}
            for name, row in result["llama.cpp"][threads].items():
                print(f"llama.cpp {name} {threads} thread(s): {row}", flush=True)
    text = json.dumps(result, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
