"""T(n) / T(1) of a model on the native backend: python curve.py DIR DTYPE [THREADS] [REPEATS]."""
import sys, torch, specdec
from specdec.bench import forward_time
from specdec.target import load_target
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
torch.set_num_threads(threads)
path, dtype = sys.argv[1], sys.argv[2]
t = load_target(path, dtype=dtype, backend="native")
sizes = [1, 2, 4, 5, 8, 16, 17, 32, 64]
ms = {n: 1e3 * forward_time(t.backend, n, 200, repeats=int(sys.argv[4]) if len(sys.argv) > 4 else 15) for n in sizes}
print(specdec.__file__.split("/src/")[0], dtype, "T(1) = %.2f ms" % ms[1], " ".join(f"{n}:{ms[n]/ms[1]:.2f}" for n in sizes))
