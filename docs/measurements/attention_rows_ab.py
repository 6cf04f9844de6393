"""The attention kernel of versions of kernels.c, each in its own process (alternating ROUNDS times): 30 calls
(SmolLM2's layers: 9 query heads over 3 key heads, D 64) of n query rows over 200 + n cached columns, float32
and bfloat16, 2 threads, best of 15 per run, then the best over runs, ms.

    python docs/measurements/attention_rows_ab.py ROUNDS A.c B.c ...
"""
import subprocess
import sys
from pathlib import Path

ONE = r"""
import hashlib, sys, time, torch
from pathlib import Path
from specdec.models import kernels
source = sys.argv[1]
copy = Path("/tmp") / f"attention-ab-{hashlib.sha1(source.encode()).hexdigest()[:12]}.c"
copy.write_text(Path(source).read_text())
kernels.SOURCE = copy
kernels._library = kernels.load_library(kernels.build())
kernels.set_threads(2)
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for n in (1, 4, 16, 64):
        T = 200 + n
        q = torch.randn(1, n, 9, 64, generator=g).to(dtype)
        kv = torch.randn(2, 1, 3, T, 64, generator=g).to(dtype)
        visible = torch.ones(1, n, T, dtype=torch.bool)
        out = torch.empty(1, n, 9 * 64, dtype=dtype)
        best = float("inf")
        for _ in range(15):
            start = time.perf_counter()
            for _ in range(30):
                kernels.attention(q, kv[0], kv[1], visible, out, 0.125)
            best = min(best, time.perf_counter() - start)
        print(f"{str(dtype)[6:]} {n} {best * 1e3:.4f}")
"""


def main() -> int:
    rounds, sources = int(sys.argv[1]), sys.argv[2:]
    best = {}
    for _ in range(rounds):
        for source in sources:
            out = subprocess.run([sys.executable, "-c", ONE, source], check=True, capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                dtype, n, ms = line.split()
                key = (source, dtype, int(n))
                best[key] = min(best.get(key, float("inf")), float(ms))
    for dtype in ("float32", "bfloat16"):
        for n in (1, 4, 16, 64):
            cells = [f"{Path(s).name} {best[s, dtype, n]:.3f}" for s in sources]
            ratios = [f"{best[s, dtype, n] / best[sources[0], dtype, n]:.2f}" for s in sources[1:]]
            print(f"{dtype:8s} n={n:2d}  " + "  ".join(cells) + "  ratio to the first: " + " ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
