"""Whole forward passes (context 200, 2 threads) at several thresholds of weight bytes from which a
quantized product splits between threads (sd_set_parallel_bytes; float products use twice it), the
threshold switched in one process, best of 5 rounds per block size.

    python docs/measurements/parallel_bytes_ab.py MODEL DTYPE BYTES,BYTES,... Ms
    e.g. python docs/measurements/parallel_bytes_ab.py smollm2-135m-q4_1 float32 524288,262144,131072,65536,32768 1,2
"""
import sys

from specdec.backends.costs import forward_time
from specdec.backends.target import load_target
from specdec.models import kernels

target = load_target(sys.argv[1], backend="native", dtype=sys.argv[2])
kernels.set_threads(2)
library = kernels.library()
thresholds = [int(v) for v in sys.argv[3].split(",")]
sizes = [int(v) for v in sys.argv[4].split(",")]
best = {}
for _ in range(5):
    for threshold in thresholds:
        library.sd_set_parallel_bytes(threshold)
        for n in sizes:
            best[threshold, n] = min(best.get((threshold, n), float("inf")), forward_time(target.backend, n, 200, repeats=9))
print(kernels.cpu_summary(), "2 threads")
for n in sizes:
    print(f"n={n:2d} " + "  ".join(f"{threshold} B: {best[threshold, n] * 1e3:6.2f} ms" for threshold in thresholds))
