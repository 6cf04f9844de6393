"""Whole forward passes (backends.costs.forward_time: 30 layers and the head, context 200, 2 threads) of
versions of kernels.c, each version in its own process, the processes alternating for ROUNDS rounds; the
best time per block size and version, and each version's ratio to the first. Separate processes because
two libraries loaded side by side keep two pools of spinning worker threads on the same cores (the
in-process A/B of forward_ab_sources.py measured a 4.8 ms pass at 9 ms that way).

    python forward_ab_runs.py MODEL Ms DTYPE ROUNDS A.c B.c ...
    e.g. python forward_ab_runs.py smollm2-135m-q4_1 1,2,4,6,8,16 float32 4 old.c src/specdec/models/kernels.c
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ONE = r"""
import hashlib, json, sys
from pathlib import Path
from specdec.models import kernels
source, model, ms, dtype = sys.argv[1:5]
copy = Path("/tmp") / f"forward-ab-{hashlib.sha1(source.encode()).hexdigest()[:12]}.c"
copy.write_text(Path(source).read_text())
kernels.SOURCE = copy
kernels._library = kernels.load_library(kernels.build())
from specdec.backends.costs import forward_time
from specdec.backends.target import load_target
target = load_target(model, backend="native", dtype=dtype)
kernels.set_threads(2)
print(json.dumps({n: forward_time(target.backend, int(n), 200) for n in ms.split(",")}))
"""


def main() -> int:
    model, ms, dtype, rounds, *sources = sys.argv[1:]
    best: dict[str, dict[str, float]] = {}
    for _ in range(int(rounds)):
        for source in sources:
            out = subprocess.run([sys.executable, "-c", ONE, source, model, ms, dtype], check=True,
                                 capture_output=True, text=True).stdout
            times = json.loads(out.strip().splitlines()[-1])
            mine = best.setdefault(source, {})
            for n, t in times.items():
                mine[n] = min(mine.get(n, t), t)
    first = best[sources[0]]
    for n in first:
        cells = [f"{Path(s).name} {best[s][n] * 1e3:7.2f} ms" for s in sources]
        ratios = [f"{best[s][n] / first[n]:.3f}" for s in sources[1:]]
        print(f"n={n:>3}  " + "  ".join(cells) + "  ratio to the first: " + " ".join(ratios), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
