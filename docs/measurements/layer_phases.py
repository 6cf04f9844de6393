"""Where a forward pass of the real target goes, phase by phase: a copy of kernels.c with wall-clock timers
around each part of a decoder layer (the q/k/v product, RoPE and the cache writes, attention, the o product,
gate/up, SiLU, down), built into a temporary library; the rest of the pass (the head, the embedding, Python) is
the pass's time less the layers' parts. Context 200, 2 threads; the best of 7 rounds of 20 passes, ms a pass.

    python docs/measurements/layer_phases.py MODEL DTYPE NS     (e.g. smollm2-135m bfloat16 1,4,9,16)
"""
import ctypes
import sys
import tempfile
from pathlib import Path

import torch

from specdec.backends.costs import _passes
from specdec.backends.target import load_target
from specdec.models import kernels
from specdec.zoo import zoo_path

PARTS = ["qkv", "rope+kv", "attn", "o", "gate_up", "silu", "down"]


def timed_source(text: str) -> str:
    """kernels.c with the timers: each replacement's anchor must be there exactly once."""
    def swap(text, old, new):
        assert text.count(old) == 1, old[:60]
        return text.replace(old, new)

    text = swap(text, "static int layer_keys_values(const struct sd_layer* w,",
                "double sd_ph[8];\nstatic double ph_now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);"
                " return ts.tv_sec + 1e-9 * ts.tv_nsec; }\nvoid sd_phase_report(double* out) { for (int i = 0; i < 8; i++)"
                " { out[i] = sd_ph[i]; sd_ph[i] = 0; } }\nstatic int layer_keys_values(const struct sd_layer* w,")
    qkv = ("    if (product(x_attn, M, K, K, w->qkv, w->qkv_type, w->qkv_gain, width, w->qkv_bias, NULL, 0, b->qkv, width,\n"
           "                attn_eps, dtype)) return 1;")
    text = swap(text, qkv, "    double t0 = ph_now();\n" + qkv + "\n    sd_ph[0] += ph_now() - t0; t0 = ph_now();")
    text = swap(text, "            memcpy((char*)b->values + at, v + h * D * es, D * es);\n        }\n    }\n    return 0;",
                "            memcpy((char*)b->values + at, v + h * D * es, D * es);\n        }\n    }\n"
                "    sd_ph[1] += ph_now() - t0;\n    return 0;")
    text = swap(text, "    if (layer_keys_values(w, b, x_attn, K, attn_eps, 1)) return 1;\n    if (sd_attention(",
                "    if (layer_keys_values(w, b, x_attn, K, attn_eps, 1)) return 1;\n    double t0 = ph_now();\n"
                "    if (sd_attention(")
    text = swap(text, "    if (product(b->attn, M,", "    sd_ph[2] += ph_now() - t0; t0 = ph_now();\n    if (product(b->attn, M,")
    text = swap(text, "    if (product(x_out, M, H, H, w->gate_up,",
                "    sd_ph[3] += ph_now() - t0; t0 = ph_now();\n    if (product(x_out, M, H, H, w->gate_up,")
    text = swap(text, "    sd_silu_mul(b->gate_up, M, w->inner, 2 * w->inner, b->act, w->inner, dtype);\n    return product(",
                "    sd_ph[4] += ph_now() - t0; t0 = ph_now();\n"
                "    sd_silu_mul(b->gate_up, M, w->inner, 2 * w->inner, b->act, w->inner, dtype);\n"
                "    sd_ph[5] += ph_now() - t0; t0 = ph_now();\n    int status = product(")
    text = swap(text, "                   -1.0f, dtype);\n}\n\nint sd_decoder_layer(",
                "                   -1.0f, dtype);\n    sd_ph[6] += ph_now() - t0;\n    return status;\n}\n\n"
                "int sd_decoder_layer(")
    return text


def main(model: str, dtype: str, sizes: list[int]) -> None:
    source = Path(tempfile.mkdtemp(prefix="specdec-phases-")) / "kernels.c"
    source.write_text(timed_source(kernels.SOURCE.read_text()))
    kernels.SOURCE = source
    lib = kernels.load_library(kernels.build())
    kernels._library = lib
    torch.set_num_threads(2)
    lib.sd_set_threads(2)
    target = load_target(zoo_path(model), dtype=dtype, backend="native")
    print(kernels.cpu_summary(), model, dtype, "2 threads, context 200, ms a pass")
    out = (ctypes.c_double * 8)()
    for n in sizes:
        time_pass, threads = _passes(target.backend, 200, [n], 1)
        best = None
        with threads:
            for _ in range(5):
                time_pass(n)
            for _ in range(7):
                lib.sd_phase_report(out)
                total = sum(time_pass(n) for _ in range(20)) / 20
                lib.sd_phase_report(out)
                parts = [out[i] / 20 for i in range(len(PARTS))]
                if best is None or total < best[0]:
                    best = (total, parts)
        total, parts = best
        print(f"n={n:3d}: pass {1e3 * total:.2f}; " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in zip(PARTS, parts))
              + f"; rest (head, embedding, Python) {1e3 * (total - sum(parts)):.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")])
