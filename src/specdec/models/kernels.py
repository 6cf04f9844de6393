"""Shape-invariant kernels: the native forward pass computes every row bit for bit the same
whatever the block around it.

Why specdec has its own: library kernels (MKL, oneDNN, PyTorch's SDPA) choose their blocking and
reduction order from the shape of each call. A verification step computes a row inside a block
of k + 1 (or a tree, or beside other rows of a batch) where plain decoding computes it alone, so
the same row gets slightly different numbers and near-ties flip: measured here, MKL's float32
products give a row different bits when a call has 1-3, 5-7 or 9-11 rows than with 4, 8 or 12+,
and in bfloat16 speculative output differed from plain decoding on 19 of 40 zoo generations.
``kernels.c`` fixes one order of operations per output element that depends only on the model's
sizes (its header says which); this module compiles it once per machine with the C compiler,
loads it with ctypes and wraps each kernel for tensors.

The library is built on first use into ``$SPECDEC_CACHE`` (default ``~/.cache/specdec``), named
by a hash of the source, the compiler command and the CPU, so an edit or another machine
rebuilds it. Without a C compiler the native backend is unavailable (``available()`` says why)
and "auto" falls back to transformers.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"]
NATIVE_FLAGS = ["-march=native"]
LIBS = ["-lpthread", "-lm"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PANEL = 16  # columns per packed weight panel (NR in kernels.c)

_library: ctypes.CDLL | None = None
_failure: str | None = None


class KernelBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("SPECDEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec")
    return Path(root)


def writable(directory: Path) -> Path:
    """``directory`` (created), or a per-user temporary one where it cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"specdec-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cpu_fingerprint() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor() or platform.machine()


SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def fast_bfloat16() -> bool:
    """Whether library bfloat16 matmuls beat float32 here: only with bfloat16 dot products in the
    vector units (AVX512-BF16 or AMX). Without them (an AVX2-only CPU) torch's bfloat16 matmuls
    converted on the fly measured 8x slower than float32 (11 against 86 GFLOP/s on 2 cores of a Zen 3)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def native_bfloat16_faster() -> bool:
    """Whether the native backend's bfloat16 forward pass beats float32 here: with bfloat16 dot products
    (``fast_bfloat16``), or on AVX2 with bfloat16 panels of interleaved halves (measured on a Zen 1 at two
    threads: plain decoding of SmolLM2-135M at 48.9 tokens/s in bfloat16 against 30.2 in float32)."""
    return fast_bfloat16() or bf16_halves()


def cpu_summary() -> str:
    """The CPU's model name and the vector flags that decide its speed, for every speed figure."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", platform.machine())
    family = f"family {fields['cpu family']} model {fields['model']}; " if "cpu family" in fields else ""
    flags = set(fields.get("flags", "").split())
    return f"{name} ({family}{' '.join(f for f in SPEED_FLAGS if f in flags) or 'no AVX2'})"


def build(native: bool = True) -> Path:
    """Compile kernels.c (once per source, compiler command and CPU) and return the library's path.

    native=False compiles for the architecture's baseline (on x86-64: no AVX2, the portable code).
    """
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set CC) to build specdec's kernels")
    source = SOURCE.read_bytes()
    error = "unknown error"
    for extra in ((NATIVE_FLAGS, []) if native else ([],)):
        command = [cc, *FLAGS, *extra]
        key = hashlib.sha256(source + " ".join(command).encode() + cpu_fingerprint().encode()).hexdigest()[:16]
        target = writable(cache_dir()) / f"kernels-{key}.so"
        if target.is_file():
            return target
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([*command, str(SOURCE), "-o", partial, *LIBS], capture_output=True, text=True)
        if result.returncode == 0:
            os.chmod(partial, 0o755)
            os.replace(partial, target)  # atomic: a concurrent build never sees half a library
            return target
        os.unlink(partial)
        error = (result.stderr.strip().splitlines() or [error])[-1]
    raise KernelBuildError(f"building specdec's kernels with {cc} failed: {error}")


def load_library(path: Path) -> ctypes.CDLL:
    """A compiled kernels library with its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    p, i, f, n = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
    signatures = {
        "sd_linear": [p, i, i, i, p, i, p, p, i, p, i, f, n, n],
        "sd_linear_q": [p, i, i, i, p, n, i, p, p, p, i, p, i, f, n],
        "sd_qblock_bytes": [n],
        "sd_peak": [n, i, p],
        "sd_rms_norm": [p, p, i, i, i, i, i, p, f, n],
        "sd_rope": [p, i, i, i, i, p, p, n],
        "sd_silu_mul": [p, i, i, i, p, i, n],
        "sd_attention": [p, i, p, p, i, i, i, i, i, i, i, i, p, f, p, i, n],
        "sd_decoder_layer": [p, p, p, p],
        "sd_decoder_layers": [p, i, p, p, i, i, p, p, p, p, p, i],
        "sd_decoder_layer_from": [p, p, p, i, f, p, p],
        "sd_layer_keys_values": [p, p, p, i, f],
        "sd_set_threads": [n],
        "sd_set_parallel_threshold": [i],
        "sd_set_parallel_bytes": [i],
        "sd_set_spin": [i],
        "sd_greedy_accept": [p, i, i, i, i, i, p, i, p, p, p, n],
        "sd_argmax": [p, i, i, i, n, p],
        "sd_amx_pairs": [i],
        "sd_bf16_pairs": [i],
        "sd_set_amx_q_rows": [n, n],
        "sd_markov_greedy": [p, i, i, i, i, i, p, i, p, n, p, p, n, p, p, p, p, p],
    }
    for name, args in signatures.items():
        getattr(lib, name).argtypes = args
    lib.sd_vector.restype = ctypes.c_char_p
    lib.sd_qvector.restype = ctypes.c_char_p
    lib.sd_qblock_bytes.restype = ctypes.c_long
    lib.sd_peak.restype = ctypes.c_double
    lib.sd_set_threads(torch.get_num_threads())
    return lib


def builds() -> list[ctypes.CDLL]:
    """Every build this machine runs: the native one, the portable one and, where the native one has
    AVX-512, the AVX2 one (``-mno-avx512f``); for checking that they compute the same bits."""
    native = library()
    found = [native, load_library(build(native=False))]
    if native.sd_vector().decode() == "avx512":
        global NATIVE_FLAGS
        saved = NATIVE_FLAGS
        NATIVE_FLAGS = [*saved, "-mno-avx512f"]
        try:
            found.append(load_library(build()))
        finally:
            NATIVE_FLAGS = saved
    return found


def library() -> ctypes.CDLL:
    """The compiled kernels (built on first call); KernelBuildError says why when they cannot be."""
    global _library, _failure
    if _library is not None:
        return _library
    if _failure is not None:
        raise KernelBuildError(_failure)
    try:
        _library = load_library(build())
    except (KernelBuildError, OSError) as exc:
        _failure = str(exc)
        raise KernelBuildError(_failure) from None
    return _library


def available() -> str | None:
    """None when the kernels can run here, else why not."""
    try:
        library()
    except KernelBuildError as exc:
        return str(exc)
    return None


def supported_dtype(dtype: torch.dtype) -> bool:
    if dtype == torch.float16:
        return bool(library().sd_has_half())
    return dtype in DTYPES


def peak_macs(integer: bool, seconds: float = 0.2, bfloat16: bool = False, tiles: bool = False) -> float:
    """Multiply-adds per second the vector units sustain on the kernels' threads: independent chains of
    float32 FMAs (integer=False), of the int8 dot products the quantized products use (True), or
    (bfloat16=True) of what bfloat16 products run on: AVX512-BF16 pair dot products, else FMAs;
    ``tiles``: the AMX tile unit's bfloat16 products (where amx_pairs says they run)."""
    import time

    lib, macs = library(), ctypes.c_double()
    iters = 1 << 16
    mode = 3 if tiles else 2 if bfloat16 and not integer else int(integer)
    while True:
        start = time.perf_counter()
        lib.sd_peak(mode, iters, ctypes.byref(macs))
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return macs.value / elapsed
        iters *= 2 if elapsed < seconds / 4 else 1 + int(seconds / max(elapsed, 1e-9))


def bf16_pairs(k: int) -> bool:
    """Whether bfloat16 weights with input size ``k`` are packed as pairs here, [panels, K/2, 16, 2]: where
    they run on AMX tiles (amx_pairs), or on AVX512-BF16's pair dot products with ``k`` even (each load is
    then a register of pairs as it is)."""
    return available() is None and bool(library().sd_bf16_pairs(k))


def amx_pairs(k: int) -> bool:
    """Whether bfloat16 products with input size ``k`` run on the CPU's AMX tiles here (AMX-BF16, the
    OS granting the tile state, k a multiple of 32, SPECDEC_AMX not 0): their weights are then packed
    as the tile unit reads them."""
    return available() is None and bool(library().sd_amx_pairs(k))


def set_threads(threads: int) -> int:
    """Threads the kernels use, the caller included (default: torch.get_num_threads())."""
    return library().sd_set_threads(threads)


@contextmanager
def torch_single_threaded(active: bool = True):
    """torch's intra-op threads down to one inside the block (when ``active``), back after it.

    For work whose heavy part runs on these kernels (the native backend): the glue around them
    (masks, copies of logits, sampling) is small, but a torch operation on a few tens of thousands of
    elements opens a parallel region, after which torch's idle threads spin for a while on the very
    cores the kernels' threads need. Measured on SmolLM2-135M, 2 threads, AVX2 Zen 3: a verification
    step's forward pass slowed by up to a third. Switching costs under a microsecond."""
    threads = torch.get_num_threads()
    if not active or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Tensors in, tensors out. Every tensor is on the CPU with its last dimension contiguous.

HALVES = 6  # layout code of bfloat16 panels whose k-rows interleave their two halves (kernels.c)
PAIRS = 7   # layout code of bfloat16 panels as pairs of k-rows, [panels, K/2, 16, 2]


def bf16_halves() -> bool:
    """Whether this build's bfloat16 products are fastest on panels with interleaved halves (the
    eight-lane AVX2 products: one load, a shift and a mask widen sixteen weights)."""
    return available() is None and library().sd_bf16_halves() == 1


@dataclass
class Matrix:
    """A weight [K, N] (x @ w) packed once into panels of 16 columns: [ceil(N / 16), K, 16]; bfloat16
    ones as pairs [panels, K/2, 16, 2] where bf16_pairs says so (AMX tiles, AVX512-BF16), on AVX2 with each
    k-row's halves interleaved (``halves``: column j at 2j, column 8 + j at 2j + 1; the same products, bit
    for bit)."""

    packed: torch.Tensor
    rows: int  # K, the input size
    cols: int  # N, the output size
    halves: bool = False

    @property
    def layout(self) -> int:
        """The code kernels.c reads the panels by: 0, HALVES or PAIRS."""
        return PAIRS if self.packed.dim() == 4 else HALVES if self.halves else 0

    @classmethod
    def pack(cls, w: torch.Tensor, halves: bool | None = None, pairs: bool | None = None) -> "Matrix":
        """``halves``, ``pairs``: None takes this build's preference (bfloat16 only)."""
        k, n = w.shape
        panels = -(-n // PANEL)
        padded = w.new_zeros(k, panels * PANEL)
        padded[:, :n] = w
        if pairs is None:
            pairs = not halves and bf16_pairs(k)
        if w.dtype == torch.bfloat16 and pairs:   # [panels, K/2, 16, 2]
            return cls(padded.view(k // 2, 2, panels, PANEL).permute(2, 0, 3, 1).contiguous(), k, n)
        if w.dtype == torch.bfloat16 and (bf16_halves() if halves is None else halves):
            return cls(padded.view(k, panels, 2, PANEL // 2).permute(1, 0, 3, 2).reshape(panels, k, PANEL), k, n, True)
        return cls(padded.view(k, panels, PANEL).permute(1, 0, 2).contiguous(), k, n)

    def unpack(self) -> torch.Tensor:
        """The [K, N] matrix back (tests, exports)."""
        if self.packed.dim() == 4:
            return self.packed.permute(1, 3, 0, 2).reshape(self.rows, -1)[:, :self.cols]
        if self.halves:
            panels = self.packed.shape[0]
            return (self.packed.view(panels, self.rows, PANEL // 2, 2).permute(1, 0, 3, 2)
                    .reshape(self.rows, -1)[:, :self.cols])
        return self.packed.permute(1, 0, 2).reshape(self.rows, -1)[:, :self.cols]


# Weights in transparent huge pages. A forward pass streams every weight once; on 4 KiB pages that is a
# page walk every 4 KiB (a 92 MB Q4_1 model: some 23,000 a pass), on 2 MiB pages a few dozen. Measured on the
# real target (Zen 4, two threads, both orders of loading, interleaved): passes of 1-16 tokens 0.86-0.98x the
# time with Q4_1 weights, 0.90-0.99x with bfloat16 ones. Linux gives anonymous memory huge pages where it is
# asked (the usual setting, transparent_hugepage "madvise"), so the packed weights of a model large enough to
# stream from memory are copied into one mapping that asks for them. The same values at other addresses: the
# same bits.
HUGE_PAGE = 2 << 20
HUGE_PAGES_FROM = 32 << 20  # bytes of weights from which a model's are moved (smaller ones stay in the caches)


def huge_page_arena(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of uint8 from a 2 MiB boundary of a private anonymous mapping that asks the kernel for
    transparent huge pages, or None where the system has no such request (not Linux) or the mapping fails.
    Views of it keep the mapping alive."""
    import mmap

    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if advice is None or None in flags:
        return None
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags[0] | flags[1])
        region.madvise(advice)
    except (OSError, ValueError):
        return None
    arena = torch.frombuffer(region, dtype=torch.uint8)
    at = (-arena.data_ptr()) % HUGE_PAGE
    return arena[at:at + nbytes]


def move_to_huge_pages(matrices: list["Matrix | QMatrix"]) -> bool:
    """Move the packed weights of ``matrices`` (each object's ``packed`` replaced) into one huge-page arena
    when they add up to HUGE_PAGES_FROM bytes or more; whether they moved. A tensor several matrices share
    moves once; each old tensor is released as soon as it is copied (no second copy of the whole model at
    once). Kernel parameters built from the old addresses must be built again."""
    sharing: dict[int, list] = {}
    for m in matrices:
        sharing.setdefault(id(m.packed), []).append(m)
    sizes = [group[0].packed.numel() * group[0].packed.element_size() for group in sharing.values()]
    if sum(sizes) < HUGE_PAGES_FROM:
        return False
    padded = [(size + 63) // 64 * 64 for size in sizes]  # each tensor on a cache line
    arena = huge_page_arena(sum(padded))
    if arena is None:
        return False
    at = 0
    for group, size, room in zip(sharing.values(), sizes, padded):
        old = group[0].packed
        new = arena[at:at + size].view(old.dtype).view(old.shape).copy_(old)
        for m in group:
            m.packed = new
        at += room
    return True


# GGUF's block-quantized types the kernels run: 32 weights of one output column per block.
QTYPES = {"Q8_0": 3, "Q4_0": 4, "Q4_1": 5}
_GGUF_BLOCK = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}    # bytes of one block in a GGUF file
_ZERO = {"Q8_0": 128, "Q4_0": 8, "Q4_1": 0}           # code offset: w = d (code - zero) (+ m)


@dataclass
class QMatrix:
    """A block-quantized weight [K, N] (x @ w), kept quantized and packed once for the kernels: panels
    of 16 columns, each [K / 32 blocks] of (16 float16 scales, Q4_1's 16 float16 minimums, the codes
    in 4-input groups); kernels.c's quantized section describes the layout and the arithmetic.
    ``gain`` [K] float32 is the weight of the RMSNorm before the product, applied to the input
    (a quantized matrix cannot absorb it)."""

    packed: torch.Tensor          # uint8 [panels, K / 32, block bytes]
    rows: int                     # K
    cols: int                     # N
    qtype: str                    # "Q8_0", "Q4_0" or "Q4_1"
    gain: torch.Tensor | None = None

    @property
    def code(self) -> int:
        return QTYPES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    @classmethod
    def from_gguf(cls, raw, qtype: str, rows: int, cols: int, gain: torch.Tensor | None = None) -> "QMatrix":
        """From a GGUF tensor's bytes: ``cols`` output rows of ``rows / 32`` blocks each, in file order."""
        if qtype not in QTYPES:
            raise ValueError(f"quantized type {qtype} is not one the kernels run ({', '.join(QTYPES)})")
        if rows % 32:
            raise ValueError(f"a {qtype} matrix needs an input size divisible by 32, got {rows}")
        blocks = rows // 32
        data = torch.as_tensor(raw).reshape(cols, blocks, _GGUF_BLOCK[qtype]).to(torch.uint8)
        panels = -(-cols // PANEL)
        if panels * PANEL != cols:   # pad with zero blocks (scale 0): those columns are never stored
            data = torch.cat([data, data.new_zeros(panels * PANEL - cols, blocks, data.shape[2])])
        per_panel = data.view(panels, PANEL, blocks, -1).permute(0, 2, 1, 3)   # [P, nb, 16, bytes]
        parts = [per_panel[..., 0:2].reshape(panels, blocks, 32)]             # d, column after column
        if qtype == "Q4_1":
            parts.append(per_panel[..., 2:4].reshape(panels, blocks, 32))     # m
            body = per_panel[..., 4:]
        else:
            body = per_panel[..., 2:]
        if qtype == "Q8_0":   # int8 q -> code q + 128, in 8 groups of 4 inputs x 16 columns
            codes = (body ^ 0x80).reshape(panels, blocks, PANEL, 8, 4).permute(0, 1, 3, 2, 4)
        else:                 # GGUF's byte i already holds inputs i (low nibble) and 16 + i (high)
            codes = body.reshape(panels, blocks, PANEL, 4, 4).permute(0, 1, 3, 2, 4)
        parts.append(codes.reshape(panels, blocks, -1))
        packed = torch.cat(parts, dim=2).contiguous()
        return cls(packed, rows, cols, qtype, None if gain is None else gain.float().contiguous())

    @classmethod
    def quantize(cls, w: torch.Tensor, qtype: str, gain: torch.Tensor | None = None) -> "QMatrix":
        """Quantize a float weight [out, in] as llama.cpp's reference quantizers do (per 32-block)."""
        return cls.from_gguf(quantize_blocks(w, qtype), qtype, w.shape[1], w.shape[0], gain)

    def dequantize(self) -> torch.Tensor:
        """The [K, N] float32 values the codes stand for (tests, drafters that read weights)."""
        panels, blocks = self.packed.shape[:2]
        scales = self.packed[..., :32].contiguous().view(torch.float16).float()            # [P, nb, 16]
        at = 32
        minimum = None
        if self.qtype == "Q4_1":
            minimum, at = self.packed[..., 32:64].contiguous().view(torch.float16).float(), 64
        body = self.packed[..., at:].reshape(panels, blocks, -1, PANEL, 4)                 # [P, nb, g, 16, 4]
        if self.qtype == "Q8_0":
            codes = body.permute(0, 1, 3, 2, 4).reshape(panels, blocks, PANEL, 32).int()
        else:
            low, high = (body & 15).permute(0, 1, 3, 2, 4), (body >> 4).permute(0, 1, 3, 2, 4)
            codes = torch.cat([low.reshape(panels, blocks, PANEL, 16), high.reshape(panels, blocks, PANEL, 16)],
                              dim=3).int()
        values = scales[..., None] * (codes - _ZERO[self.qtype]).float()
        if minimum is not None:
            values = values + minimum[..., None]
        # [P, nb, 16, 32] -> [K, N]
        return values.permute(1, 3, 0, 2).reshape(blocks * 32, panels * PANEL)[:, :self.cols].contiguous()


def quantize_blocks(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF bytes [out, in / 32 * block bytes] of a float weight [out, in], as llama.cpp's reference
    quantizers make them: Q8_0 d = max|x| / 127, q = round(x / d); Q4_0 d = (the x of largest
    magnitude) / -8, q = min(15, trunc(x / d + 8.5)); Q4_1 d = (max - min) / 15, m = min,
    q = min(15, trunc((x - m) / d + 0.5)); scales stored as float16."""
    out, inputs = w.shape
    if inputs % 32:
        raise ValueError(f"{qtype} needs an input size divisible by 32, got {inputs}")
    x = w.float().reshape(out, inputs // 32, 32)

    def half(t):
        return t.to(torch.float16).contiguous().view(torch.uint8).reshape(*t.shape, 2)

    def inverse(d):
        return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))

    if qtype == "Q8_0":
        d = x.abs().amax(-1) / 127
        q = torch.round(x * inverse(d)[..., None]).clamp(-128, 127).to(torch.int8).view(torch.uint8)
        blocks = torch.cat([half(d), q], dim=-1)
    elif qtype == "Q4_0":
        index = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, index).squeeze(-1) / -8
        q = torch.trunc(x * inverse(d)[..., None] + 8.5).clamp(0, 15).to(torch.uint8)
        blocks = torch.cat([half(d), q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    elif qtype == "Q4_1":
        low, high = x.amin(-1), x.amax(-1)
        d = (high - low) / 15
        q = torch.trunc((x - low[..., None]) * inverse(d)[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
        blocks = torch.cat([half(d), half(low), q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    else:
        raise ValueError(f"unknown quantized type {qtype}")
    return blocks.reshape(out, -1).contiguous()


def _check(status: int) -> None:
    if status == 3:
        raise ValueError("weights packed for another build of specdec's kernels (bfloat16 panels with "
                         "interleaved halves or as pairs, which this build does not read): pack them with this one")
    if status:
        raise MemoryError("specdec's kernels could not allocate their work memory")


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a tensor viewed as [rows, last dim], rows evenly spaced."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError("kernels need the last dimension contiguous")
    if t.dim() == 1:
        return 1, t.shape[0]
    try:
        flat = t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError("kernels need rows evenly spaced") from None
    return flat.shape[0], flat.stride(0) if flat.shape[0] > 1 else t.shape[-1]


def linear(x: torch.Tensor, w: Matrix | QMatrix, out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm_eps: float | None = None) -> torch.Tensor:
    """x [..., K] @ w (+ bias) (+ residual) -> [..., N]; rows RMS-normalised first when norm_eps is given."""
    if x.shape[-1] != w.rows:
        raise ValueError(f"input of size {x.shape[-1]} for a product over {w.rows} inputs")
    rows, ldx = _rows(x)
    if out is None:
        out = x.new_empty(*x.shape[:-1], w.cols)
    out_rows, ldy = _rows(out)
    ldr, res_rows = 0, rows
    if residual is not None:
        res_rows, ldr = _rows(residual)
    for name, t, want_rows in (("output", out, out_rows), ("bias", bias, rows), ("residual", residual, res_rows)):
        if t is not None and (t.shape[-1] != w.cols or t.dtype != x.dtype or want_rows != rows):
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} for {rows} rows of {w.cols} outputs in {x.dtype}")
    if isinstance(w, QMatrix):
        status = library().sd_linear_q(x.data_ptr(), rows, w.rows, ldx, w.packed.data_ptr(), w.code, w.cols,
                                       _ptr(w.gain), _ptr(bias), _ptr(residual), ldr, out.data_ptr(), ldy,
                                       -1.0 if norm_eps is None else norm_eps, DTYPES[x.dtype])
        if status == 2:
            raise ValueError(f"a {w.qtype} product needs an input size divisible by 32, got {w.rows}")
        _check(status)
        return out
    _check(library().sd_linear(x.data_ptr(), rows, w.rows, ldx, w.packed.data_ptr(), w.cols, _ptr(bias),
                               _ptr(residual), ldr, out.data_ptr(), ldy, -1.0 if norm_eps is None else norm_eps,
                               DTYPES[x.dtype], w.layout))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension (times ``weight`` when given); ``out`` may be ``x``."""
    rows, ld = _rows(x)
    out = torch.empty_like(x) if out is None else out
    if _rows(out)[1] != ld:
        raise ValueError("rms_norm's out must have the input's row stride")
    _check(library().sd_rms_norm(x.data_ptr(), out.data_ptr(), rows, 1, x.shape[-1], ld, 0, _ptr(weight), eps,
                                 DTYPES[x.dtype]))
    return out


def head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm of each head in place: x [rows, heads, D], a view with contiguous heads."""
    rows, heads, dim = x.shape
    _check(library().sd_rms_norm(x.data_ptr(), x.data_ptr(), rows, heads, dim, x.stride(0), x.stride(1),
                                 weight.data_ptr(), eps, DTYPES[x.dtype]))


def rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate x [rows, heads, D] (pair order, contiguous heads) in place by positions [rows] (int64)."""
    rows, heads, dim = x.shape
    if x.stride(1) != dim:
        raise ValueError("rope needs contiguous heads")
    library().sd_rope(x.data_ptr(), rows, heads, dim, x.stride(0), table.data_ptr(), positions.data_ptr(),
                      DTYPES[x.dtype])


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2I] (gate first) -> [M, I]."""
    rows, ld = _rows(gate_up)
    inner = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inner) if out is None else out
    library().sd_silu_mul(gate_up.data_ptr(), rows, inner, ld, out.data_ptr(), _rows(out)[1], DTYPES[gate_up.dtype])
    return out


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
              out: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, n, heads, D] over keys/values [B, kv, T, D] (views of a cache).

    Head h reads key head h % kv (query heads in (group member, key head) order). ``visible``
    [B, n, T] bool says which columns each query sees (None: all). out [B, n, heads * D].
    """
    batch, n, heads, dim = q.shape
    kv, columns = keys.shape[1], keys.shape[2]
    if keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != dim or q.stride(2) != dim:
        raise ValueError("attention needs [B, kv, T, D] caches with contiguous columns and contiguous heads")
    if q.stride(0) != n * q.stride(1) or out.stride(0) != n * out.stride(1):
        raise ValueError("attention needs evenly spaced query rows")
    if visible is not None:
        visible = visible.contiguous()
    _check(library().sd_attention(q.data_ptr(), q.stride(1), keys.data_ptr(), values.data_ptr(), keys.stride(0),
                                  keys.stride(1), batch, n, heads, kv, dim, columns, _ptr(visible), scale,
                                  out.data_ptr(), out.stride(1), DTYPES[q.dtype]))
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) in one C call, the same index (the first largest, or the first NaN): torch's own
    is slow on bfloat16 rows (about 1.4 ms for 8 rows of 49,152 on a Zen 4 core). Falls back to
    torch where the kernels do not run or the rows are not evenly spaced."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.shape[-1] == 0 or x.dim() == 0:
        return x.argmax(-1)
    try:
        rows, ld = _rows(x)
    except ValueError:
        return x.argmax(-1)
    if available() is not None:
        return x.argmax(-1)
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    library().sd_argmax(x.data_ptr(), rows, x.shape[-1], ld, DTYPES[x.dtype], out.data_ptr())
    return out


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor):
    """Greedy verification in one call: logits [B, k+1, V] float32 or bfloat16, drafts [B, k] and
    lengths [B] long -> (accepted [B], next token [B]), as verify.chain.verify_greedy computes them;
    None when the tensors are not laid out for the kernel (the caller then uses PyTorch)."""
    if (logits.dtype not in (torch.float32, torch.bfloat16) or logits.device.type != "cpu" or logits.stride(-1) != 1
            or drafts.dtype != torch.int64 or lengths.dtype != torch.int64 or available() is not None):
        return None
    batch, width, vocab = logits.shape
    drafts, lengths = drafts.contiguous(), lengths.contiguous()
    accepted, following = torch.empty(batch, dtype=torch.int64), torch.empty(batch, dtype=torch.int64)
    library().sd_greedy_accept(logits.data_ptr(), batch, width, vocab, logits.stride(0), logits.stride(1),
                               drafts.data_ptr(), drafts.stride(0) if drafts.dim() == 2 else 0, lengths.data_ptr(),
                               accepted.data_ptr(), following.data_ptr(), DTYPES[logits.dtype])
    return accepted, following


def markov_greedy(head: torch.Tensor, w1: torch.Tensor, w2: Matrix, ids: torch.Tensor | None,
                  anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DSpark's greedy chain in one call: head [B, S, V] float32 or bfloat16 (the head's logits of S slots), w1
    [vocab, r] float32 (the Markov head's codes), w2 the packed r -> V product, ids [V] (the target id of each
    head row; None: the same), anchors [B] -> (drafts [B, S] in target ids, codes [B, S, r]): slot by slot
    what ``argmax(head[:, j].float() + linear(w1[previous].to(dtype), w2).float())`` gives, the same bits.
    None where the kernels do not run it (the caller then loops in PyTorch)."""
    if (head.dtype not in (torch.float32, torch.bfloat16) or head.device.type != "cpu" or head.stride(-1) != 1
            or w1.dtype != torch.float32 or not w1.is_contiguous() or isinstance(w2, QMatrix)
            or available() is not None):
        return None
    batch, slots, vocab = head.shape
    rank = w1.shape[1]
    ids = None if ids is None else ids.to(torch.int64).contiguous()
    anchors = anchors.to(torch.int64).contiguous()
    tokens = torch.empty(batch, slots, dtype=torch.int64)
    codes = torch.empty(batch, slots, rank, dtype=torch.float32)
    x, term = head.new_empty(batch, rank), head.new_empty(batch, vocab)
    total = torch.empty(vocab, dtype=torch.float32)
    _check(library().sd_markov_greedy(head.data_ptr(), batch, slots, vocab, head.stride(0), head.stride(1),
                                      w1.data_ptr(), rank, w2.packed.data_ptr(), w2.layout, _ptr(ids),
                                      anchors.data_ptr(), DTYPES[head.dtype], tokens.data_ptr(), codes.data_ptr(),
                                      x.data_ptr(), term.data_ptr(), total.data_ptr()))
    return tokens, codes
