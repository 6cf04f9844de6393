"""specdec beside llama.cpp: plain greedy decoding of the same weights, token ids in, tokens/s out.

llama.cpp is what a CPU user would run instead of specdec, so it is the practical bar. This module
runs it through llama-cpp-python (optional: ``pip install llama-cpp-python``; nothing else in
specdec needs it) on a GGUF file that ``specdec.commands.gguf`` exports from the same model directory, and
measures it interleaved, prompt by prompt, with specdec's plain decoding and its speculative methods:

    python -m specdec.commands.llamacpp --target DIR [--draft DIR] --tasks code-completion \\
        --num-prompts 10 --max-new-tokens 64 [-k 4] [--threads 1] [--repeats 3] \\
        [--kv-cache f32 f16] [--gguf FILE] [--json OUT]

Both sides decode greedily from the same token ids, stop after an EOS token (kept in the output)
or max_new_tokens, and count new tokens over the wall time of the whole generation, prefill
included; model loading is not counted. Greedy tokens are compared prompt by prompt: on the same
f32 weights they should be equal, except where two logits are so close that the two engines'
different summation orders pick different ones (random-weight models have such near-ties).

llama.cpp keeps its KV cache in f32 here, as specdec does; ``--kv-cache f32 f16`` adds a row for
llama.cpp's own default, f16. The random Llama of issue 7 and its 1-layer draft:
``python -c "from specdec.commands.llamacpp import save_random_llama; save_random_llama('/tmp/m26')"``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from specdec.errors import InvalidArgumentError, SpecdecError

MISSING = "llama.cpp comparison needs llama-cpp-python (pip install llama-cpp-python)"


@contextmanager
def _repacking(repack: bool):
    """llama.cpp's repacked weight buffers (its "extra buffer types": AVX-512 and AMX layouts) on or, with
    ``repack`` False, off for the models loaded inside, as ``llama-bench --repack 0`` turns them off.
    llama-cpp-python has no argument for it, so its default model parameters are wrapped meanwhile.
    Needed where llama.cpp's AMX path crashes (built with GCC 12, its tile configuration faults)."""
    if repack:
        yield
        return
    from llama_cpp import llama as module

    defaults = module.llama_cpp.llama_model_default_params

    def without_repacking():
        params = defaults()
        params.use_extra_bufts = False
        return params

    module.llama_cpp.llama_model_default_params = without_repacking
    try:
        yield
    finally:
        module.llama_cpp.llama_model_default_params = defaults


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as error:
        if error.name not in (None, "llama_cpp"):  # the package is there, a module it imports is not
            raise SpecdecError(f"llama-cpp-python cannot be imported: it needs the module {error.name!r} "
                               f"(pip install {error.name})") from None
        raise SpecdecError(MISSING) from None
    return llama_cpp


KV_CACHE_TYPES = ("f32", "f16")


class LlamaCpp:
    """A GGUF model loaded in llama.cpp, decoding greedily from token ids on ``threads`` threads.

    ``kv_cache``: "f32" (default) keeps keys and values in float32 as specdec does, so on f32
    weights the logits agree with transformers' to about 1e-5; "f16" is llama.cpp's own default
    (logits then differ by about 1e-3).
    """

    def __init__(self, gguf_path: str | os.PathLike, n_ctx: int = 2048, threads: int = 1, kv_cache: str = "f32",
                 logits_all: bool = False, repack: bool = True):
        llama_cpp = _llama_cpp()
        import numpy as np

        if kv_cache not in KV_CACHE_TYPES:
            raise InvalidArgumentError(f"unknown KV cache type {kv_cache!r}; choose from {', '.join(KV_CACHE_TYPES)}")
        if not Path(gguf_path).is_file():
            raise InvalidArgumentError(f"no GGUF file at {gguf_path}")
        self._np = np
        self._lib = llama_cpp
        self.n_ctx = n_ctx
        kv_type = llama_cpp.GGML_TYPE_F32 if kv_cache == "f32" else llama_cpp.GGML_TYPE_F16
        # n_batch = n_ctx: a prompt is one decode call, as it is one forward pass in specdec.
        with _repacking(repack):
            self.llm = llama_cpp.Llama(model_path=os.fspath(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                       n_threads_batch=threads, logits_all=logits_all, verbose=False,
                                       type_k=kv_type, type_v=kv_type)
        self.n_vocab = self.llm.n_vocab()

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def last_logits(self):
        """The logits after the last evaluated token: a float32 numpy view [V] (valid until the next eval)."""
        pointer = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        return self._np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def prefill(self, prompt: list[int]):
        """Start a fresh sequence (the KV cache emptied) with ``prompt``; returns its last logits."""
        if len(prompt) >= self.n_ctx:
            raise InvalidArgumentError(f"prompt of {len(prompt)} tokens does not fit n_ctx {self.n_ctx}")
        self.llm.reset()  # eval() then drops every cached position from 0 on
        self.llm.eval(prompt)
        return self.last_logits()

    def greedy(self, prompt: list[int], max_new_tokens: int, eos_ids) -> list[int]:
        """New tokens after ``prompt``: argmax each step, stopping after an EOS token or max_new_tokens."""
        if max_new_tokens <= 0:
            return []
        if len(prompt) + max_new_tokens > self.n_ctx:
            raise InvalidArgumentError(
                f"prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds n_ctx {self.n_ctx}")
        eos = {int(e) for e in eos_ids}
        argmax = self._np.argmax
        token = int(argmax(self.prefill(prompt)))
        out = [token]
        while len(out) < max_new_tokens and token not in eos:
            self.llm.eval([token])
            token = int(argmax(self.last_logits()))
            out.append(token)
        return out

    def lookup(self, prompt: list[int], max_new_tokens: int, eos_ids, k: int) -> tuple[list[int], int]:
        """Greedy decoding sped up by llama-cpp-python's own prompt lookup (``LlamaPromptLookupDecoding``,
        n-grams of up to 3 tokens, ``k`` drafts), each block checked in one llama.cpp batch: (new tokens,
        verification steps). Needs a runner made with ``logits_all=True``."""
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        np = self._np
        drafter = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=k)
        eos = {int(e) for e in eos_ids}
        token = int(np.argmax(self.prefill(prompt)))
        tokens, out, steps = list(prompt), [token], 0
        while len(out) < max_new_tokens and token not in eos:
            tokens.append(token)
            drafts = [int(t) for t in drafter(np.array(tokens, dtype=np.intc))][: max_new_tokens - len(out)]
            start = self.llm.n_tokens
            self.llm.eval([token] + drafts)
            logits = np.ctypeslib.as_array(self._lib.llama_get_logits(self.llm.ctx),
                                           shape=(len(drafts) + 1, self.n_vocab))
            steps += 1
            accepted = 0
            while accepted < len(drafts) and int(np.argmax(logits[accepted])) == drafts[accepted]:
                accepted += 1
                if drafts[accepted - 1] in eos:
                    break
            out.extend(drafts[:accepted])
            tokens.extend(drafts[:accepted])
            if accepted and drafts[accepted - 1] in eos:
                break
            token = int(np.argmax(logits[accepted]))
            out.append(token)
            self.llm.n_tokens = start + 1 + accepted  # the next eval drops the rejected positions
        return out[:max_new_tokens], steps

    def plain(self, prompts: list[list[int]], max_new_tokens: int, eos_ids) -> tuple[list[list[int]], float]:
        """Greedy decoding of each prompt in turn; (outputs, seconds of wall time, prefills included)."""
        outputs, seconds = [], 0.0
        for prompt in prompts:
            start = time.perf_counter()
            outputs.append(self.greedy(prompt, max_new_tokens, eos_ids))
            seconds += time.perf_counter() - start
        return outputs, seconds

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's tokenization of ``text``, without BOS, special tokens recognised."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def llama_cpp_plain(gguf_path: str | os.PathLike, prompts: list[list[int]], max_new_tokens: int, eos_ids,
                    threads: int = 1, kv_cache: str = "f32") -> tuple[list[list[int]], float]:
    """Greedy plain decoding of ``prompts`` (token ids) in llama.cpp: (new tokens per prompt, seconds).

    Stops after an EOS token of ``eos_ids`` (kept, as specdec keeps it) or max_new_tokens. Seconds are
    the wall time of the generations, prompt processing included, model loading not.
    """
    if not prompts:
        raise InvalidArgumentError("no prompts given")
    n_ctx = max(len(p) for p in prompts) + max_new_tokens + 8
    with LlamaCpp(gguf_path, n_ctx=n_ctx, threads=threads, kv_cache=kv_cache) as runner:
        return runner.plain(prompts, max_new_tokens, eos_ids)


# ---------------------------------------------------------------------------------------------
# The comparison.

def save_random_llama(directory: str | os.PathLike, layers: int = 8, hidden: int = 512, seed: int = 0):
    """A random Llama with the zoo tokenizer, and a 1-layer draft cut from it; returns (target, draft) dirs.

    The defaults are issue 7's model: 8 layers x 512, intermediate 1536, 8 heads, 4 key/value
    heads, vocab 4096, untied head (29.4M parameters), seed 0. The draft keeps the target's first
    layer, embedding, final norm and head, as ``specdec.commands.tiny.save_bench_pair`` does. Random weights
    say nothing about acceptance; the model only makes forward passes cost what a bigger one does.
    """
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.backends.hf import quiet
    from specdec.zoo import data_dir

    directory = Path(directory)
    zoo = data_dir() / "target"
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=0, pad_token_id=1, tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})).eval()
    draft.load_state_dict({name: value for name, value in target.state_dict().items()
                           if not name.startswith("model.layers.") or name.startswith("model.layers.0.")})
    paths = (directory, directory.with_name(directory.name + "-draft"))
    for model, path in zip((target, draft), paths):
        with quiet():
            model.save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(zoo / name, path / name)
    return paths


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two outputs differ (length included), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(target_dir: str | os.PathLike, draft_dir: str | os.PathLike | None = None,
            tasks: str = "code-completion", num_prompts: int = 10, max_new_tokens: int = 64, k: int = 4,
            threads: int = 1, gguf_path: str | os.PathLike | None = None, backend: str = "auto",
            kv_caches: tuple[str, ...] = ("f32",), repeats: int = 1, progress: bool = True, repack: bool = True,
            dtype: str = "auto") -> dict:
    """Measure llama.cpp's plain decoding beside specdec's methods on the same prompts, interleaved.

    Every method runs each prompt ``repeats`` times (after one untimed warm-up prompt), in an order
    rotated from prompt to prompt; tokens are compared on the first round. ``gguf_path``: an
    existing export of ``target_dir`` (None: the GGUF file a folder holds as its weights, else an export to a
    temporary file). ``kv_caches``:
    llama.cpp's KV cache type(s), one llama.cpp row each; the first is the reference of the ratios
    and of the token comparison. ``dtype``: what specdec computes in (float32 or bfloat16); "auto" takes
    the type of the GGUF file both run (bfloat16 for a BF16 file, float32 otherwise), and an export of a
    folder is made in that type, so both sides read the same weights. Returns the table as a dict
    (``format_comparison`` prints it).
    """
    import torch

    from specdec.decode import GenerationConfig
    from specdec.engine import generate_ids
    from specdec.drafters import DraftModel, NoDraft, PromptLookup
    from specdec.commands.gguf import export
    from specdec.backends.target import load_target, resolve_model
    from specdec.models.llama import gguf_weights
    from specdec.zoo.tasks import load_tasks

    if min(num_prompts, max_new_tokens, k, threads, repeats) < 1:
        raise InvalidArgumentError("num_prompts, max_new_tokens, k, threads and repeats must be >= 1")
    if not kv_caches or any(kind not in KV_CACHE_TYPES for kind in kv_caches):
        raise InvalidArgumentError(f"KV cache types must be among {', '.join(KV_CACHE_TYPES)}")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise InvalidArgumentError(f"dtype must be float32, bfloat16 or auto, not {dtype!r}")
    llama_cpp = _llama_cpp()  # fail before any work when it is missing
    torch.set_num_threads(threads)
    folder = Path(resolve_model(target_dir))
    weights = gguf_path or gguf_weights(folder)
    if dtype == "auto":
        dtype = file_dtype(weights) if weights is not None else "float32"
    target = load_target(target_dir, dtype=dtype, backend=backend)
    prompts = target.encode(load_tasks(tasks, tokenizer=target.tokenizer)[:num_prompts])
    eos = list(target.eos_token_ids)

    def specdec_method(drafter, k):
        config = GenerationConfig(num_draft_tokens=k, max_new_tokens=max_new_tokens)

        def run(prompt):
            out = generate_ids(target, [prompt], drafter, config)
            return out.token_ids[0], out.stats
        return run

    def llama_cpp_method(runner):
        return lambda prompt: (runner.greedy(prompt, max_new_tokens, eos), None)

    def lookup_run(runner, prompt):
        from types import SimpleNamespace

        output, steps = runner.lookup(prompt, max_new_tokens, eos, k)
        return output, SimpleNamespace(tokens_from_steps=len(output) - 1, verify_steps=steps)

    specdec = {"specdec plain": specdec_method(NoDraft(), 1)}
    if draft_dir is not None:
        specdec[f"specdec draft-model k={k}"] = specdec_method(DraftModel(draft_dir, backend=backend), k)
    specdec[f"specdec prompt-lookup k={k}"] = specdec_method(PromptLookup(), k)

    with tempfile.TemporaryDirectory(prefix="specdec-gguf-") as scratch, ExitStack() as runners:
        if weights is None:  # a folder whose weights are a GGUF file runs that file; else an export in dtype
            weights = export(folder, Path(scratch) / "target.gguf", "bf16" if dtype == "bfloat16" else "f32")
        n_ctx = max(len(p) for p in prompts) + max_new_tokens + 8
        methods = {f"llama.cpp plain ({kind} KV)": llama_cpp_method(runners.enter_context(
            LlamaCpp(weights, n_ctx=n_ctx, threads=threads, kv_cache=kind, repack=repack)))
            for kind in dict.fromkeys(kv_caches)}
        reference_name = next(iter(methods))
        lookup = runners.enter_context(LlamaCpp(weights, n_ctx=n_ctx, threads=threads, kv_cache=kv_caches[0],
                                                logits_all=True, repack=repack))
        methods[f"llama.cpp prompt-lookup k={k} ({kv_caches[0]} KV)"] = lambda prompt: lookup_run(lookup, prompt)
        methods.update(specdec)
        rows = {name: {"method": name, "seconds": 0.0, "new_tokens": 0, "outputs": [], "tau_tokens": 0,
                       "tau_steps": 0} for name in methods}
        for run in methods.values():  # warm-up, untimed
            run(prompts[0])
        names = list(methods)
        for rep in range(repeats):
            for index, prompt in enumerate(prompts):
                for turn in range(len(names)):
                    name = names[(index + rep + turn) % len(names)]
                    start = time.perf_counter()
                    output, stats = methods[name](prompt)
                    rows[name]["seconds"] += time.perf_counter() - start
                    rows[name]["new_tokens"] += len(output)
                    if rep == 0:
                        rows[name]["outputs"].append(output)
                    if stats is not None:
                        rows[name]["tau_tokens"] += stats.tokens_from_steps
                        rows[name]["tau_steps"] += stats.verify_steps
                if progress:
                    print(f"round {rep + 1}/{repeats}, prompt {index + 1}/{len(prompts)} done", file=sys.stderr)

    reference, plain = rows[reference_name], rows["specdec plain"]
    base = reference["new_tokens"] / reference["seconds"]
    plain_rate = plain["new_tokens"] / plain["seconds"]
    table = []
    for row in rows.values():
        rate = row["new_tokens"] / row["seconds"]
        differences = [first_difference(a, b) for a, b in zip(row["outputs"], reference["outputs"])]
        table.append({
            "method": row["method"], "tokens_per_second": rate, "new_tokens": row["new_tokens"],
            "seconds": row["seconds"], "vs_llama_cpp": rate / base, "vs_specdec_plain": rate / plain_rate,
            "tau": row["tau_tokens"] / row["tau_steps"] if row["tau_steps"] else None,
            "identical_to_llama_cpp": sum(d is None for d in differences),
            "identical_to_specdec_plain": sum(a == b for a, b in zip(row["outputs"], plain["outputs"])),
            "first_difference": differences})
    speculative = [r for r in table if r["method"] in specdec and r["method"] != "specdec plain"]
    best = max(speculative, key=lambda r: r["tokens_per_second"])
    return {"target": str(target_dir), "draft": None if draft_dir is None else str(draft_dir),
            "backend": target.backend.description, "dtype": dtype, "tasks": tasks, "num_prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "threads": threads, "k": k, "repeats": repeats,
            "llama_cpp_version": getattr(llama_cpp, "__version__", "?"), "reference": reference_name,
            "methods": table, "best_speculative": best["method"]}


def file_dtype(path: str | os.PathLike) -> str:
    """bfloat16 where most of a GGUF file's matrices are BF16, float32 otherwise (quantized and float
    files run with float32 activations)."""
    from specdec.models.gguf import GGUFFile

    types = [kind for name, kind in GGUFFile(path).tensor_types().items() if name.endswith(".weight")]
    return "bfloat16" if 2 * types.count("BF16") > len(types) else "float32"


def format_comparison(result: dict) -> str:
    n = result["num_prompts"]
    rows = {row["method"]: row for row in result["methods"]}
    reference, plain, best = rows[result["reference"]], rows["specdec plain"], rows[result["best_speculative"]]
    header = (f"target {result['target']} (specdec backend {result['backend']}, {result.get('dtype', 'float32')}), "
              f"{n} {result['tasks']} prompts, "
              f"{result['max_new_tokens']} new tokens, {result['repeats']} round(s), {result['threads']} thread(s), "
              f"llama-cpp-python {result['llama_cpp_version']}")
    columns = (f"| method | tokens/s | x {reference['method']} | x specdec plain | tau | greedy = llama.cpp "
               "| = specdec plain |")
    lines = [header, columns, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["methods"]:
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        lines.append(f"| {row['method']} | {row['tokens_per_second']:.1f} | {row['vs_llama_cpp']:.2f} | "
                     f"{row['vs_specdec_plain']:.2f} | {tau} | {row['identical_to_llama_cpp']}/{n} | "
                     f"{row['identical_to_specdec_plain']}/{n} |")
    lines.append(f"{reference['method']} / specdec plain: {1 / plain['vs_llama_cpp']:.2f}x; "
                 f"/ specdec's best speculative ({best['method']}): {1 / best['vs_llama_cpp']:.2f}x")
    differing = [(i, d) for i, d in enumerate(plain["first_difference"]) if d is not None]
    if differing:
        lines.append("specdec plain differs from llama.cpp on prompt(s) "
                     + ", ".join(f"{i} (from new token {d})" for i, d in differing))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specdec.commands.clitools import ArgumentParser
    from specdec.models.files import check_output_path, write_atomic

    parser = ArgumentParser(prog="python -m specdec.commands.llamacpp",
                            description="Compare specdec with llama.cpp's plain greedy decoding on the same weights.")
    parser.add_argument("--target", required=True, metavar="DIR", help="target model directory (HF layout)")
    parser.add_argument("--draft", metavar="DIR", help="draft model directory (adds draft-model decoding)")
    parser.add_argument("--tasks", default="code-completion", help="zoo task set (default code-completion)")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="threads for torch and llama.cpp (default 1)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the prompts (default 1)")
    parser.add_argument("--backend", choices=("auto", "native", "hf"), default="auto", help="specdec's backend")
    parser.add_argument("--gguf", metavar="FILE", help="an existing GGUF export of --target (default: export one)")
    parser.add_argument("--kv-cache", nargs="+", choices=KV_CACHE_TYPES, default=["f32"],
                        help="llama.cpp's KV cache type(s), one row each; the first is the reference "
                             "(default f32, as specdec's; f16 is llama.cpp's own default)")
    parser.add_argument("--no-repack", action="store_true",
                        help="llama.cpp without its repacked weight buffers (llama-bench --repack 0): its AMX path "
                             "crashes where it was built by GCC 12")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="what specdec computes in (default auto: bfloat16 for a BF16 GGUF file, float32 otherwise; "
                             "a folder's export is made in this type)")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    try:
        check_output_path(args.json)
        result = compare(args.target, args.draft, args.tasks, args.num_prompts, args.max_new_tokens, args.k,
                         args.threads, args.gguf, args.backend, tuple(args.kv_cache), args.repeats,
                         repack=not args.no_repack, dtype=args.dtype)
        if args.json:
            write_atomic(args.json, json.dumps(result, indent=2) + "\n")
    except SpecdecError as exc:
        print(f"specdec.commands.llamacpp: error: {exc}", file=sys.stderr)
        return 2
    print(format_comparison(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
