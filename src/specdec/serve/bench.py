"""`specdec bench-serve`: waves of concurrent streaming clients against an OpenAI-compatible server.

Each client is a thread sending its requests in turn (greedy, streamed, prompts taken in order from
a task set); a wave runs ``concurrency`` clients. Per wave:

* per-user tokens/s: the mean over requests of completion tokens / end-to-end seconds (from sending
  the request to its last token), what one user sees;
* throughput: every completion token of the wave / the wave's wall time;
* TTFT: sending to the first streamed text; ITL: gaps between streamed chunks (a speculative step may
  bring several tokens in one chunk, as vLLM's benchmark counts them); TPOT: per request,
  (last - first token) / (tokens - 1);
* mean acceptance length: 1 + accepted / drafts from the server's /metrics counters over the wave
  (tokens per verification step, vLLM's definition).

A mode is ``plain`` (no drafter), a policy text (``fixed``, ``load-aware``, ``confidence``,
``conf-min:0.5``, ``static:...``) for ``--drafter``, or ``DRAFTER[=DIR]@POLICY`` for a drafter of its
own, so one run compares, say, plain decoding, DFlash at a fixed block and DSpark under both
confidence policies: ``plain dflash@fixed dspark=DIR@conf-min:0.5 dspark=DIR@confidence``.

Every mode gets a fresh engine and server on the same target, in a process of its own by default (so
the client threads and the engine share neither a core nor Python's lock), or in this process
(``--in-process``); its start-up time (loading, the engine with its profiling, the HTTP server) is
reported beside the waves. All servers start first; then each concurrency runs every mode's wave one
after the other, so the modes are compared minutes apart at most (timings drift on a shared machine).
With ``--rounds R`` each concurrency runs R rounds of every mode's wave, the modes' order reversed
every other round (so a drift in the machine's speed weighs on every mode alike); ``rounds_summary``
then gives each mode's median throughput and per-user speed, and its ratio to the first mode taken
within each round (waves seconds apart) and its median: the comparison a one-wave spread cannot make.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec.serve import BackgroundServer, create_app
from specdec.serve.runner import build_engine

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")


@dataclass(frozen=True)
class Mode:
    """One server of a bench-serve run: a drafter, its folder and a policy."""

    label: str                  # as the table and the JSON name it
    drafter: str | None = None  # a registry name; None: --drafter; "none": plain decoding
    folder: str | None = None   # the drafter's folder; None: --draft for --drafter, else the zoo's
    policy: str | None = None   # schedule.parse_policy's text; None with plain decoding

    @property
    def plain(self) -> bool:
        return self.drafter == "none"


def parse_mode(text: str) -> Mode:
    """``plain``, ``POLICY`` (for --drafter) or ``DRAFTER[=DIR]@POLICY``; the drafter and the policy are
    checked here, before any model loads."""
    from specdec.drafters.registry import resolve
    from specdec.errors import InvalidArgumentError
    from specdec.schedule import parse_policy

    spec, at, policy = text.rpartition("@")
    if not at:
        policy = text
    if policy == "plain":
        if spec:
            raise InvalidArgumentError(f"mode {text!r}: plain decoding takes no drafter (write plain)")
        return Mode("plain", "none")
    parse_policy(policy)
    if not at:
        return Mode(text, policy=policy)
    name, _, folder = spec.partition("=")
    if not name:
        raise InvalidArgumentError(f"mode {text!r}: name a drafter before '@' (DRAFTER[=DIR]@POLICY)")
    name = resolve(name)
    if name == "none":
        raise InvalidArgumentError(f"mode {text!r}: plain decoding is the mode plain")
    label = f"{name}{'=' + Path(folder).name if folder else ''}@{policy}"
    return Mode(label, name, folder or None, policy)


def resolve_mode(mode: Mode, args, zoo_target: bool) -> Mode:
    """A mode's drafter and folder filled in: --drafter and --draft where it names none, the folder
    committed for a real target (``smollm2-135m/dflash``), the zoo's for a drafter the zoo trains for
    its own target."""
    from specdec.drafters.registry import REGISTRY
    from specdec.errors import InvalidArgumentError

    if mode.plain:
        return mode
    if mode.drafter is None or (mode.drafter == args.drafter and mode.folder is None):
        mode = dataclasses.replace(mode, drafter=args.drafter, folder=mode.folder or args.draft)
        if mode.folder is not None or not REGISTRY[mode.drafter].folder:
            return mode
    entry = REGISTRY[mode.drafter]
    if entry.zoo_variant:
        raise InvalidArgumentError(f"mode {mode.label}: {entry.name} drafts with a model of its own; the modes share "
                                   "one target, so give it as --drafter")
    folder = mode.folder
    if entry.folder and folder is None:
        from specdec.drafters.registry import default_folder
        from specdec.zoo import zoo_path
        folder = default_folder(entry.name, str(getattr(args, "target", "")))  # the drafter trained for it
        if folder is None and zoo_target and entry.zoo:
            folder = str(zoo_path(entry.zoo))
        elif folder is None:
            raise InvalidArgumentError(f"mode {mode.label}: {entry.name} needs its folder, as "
                                       f"{entry.name}=DIR@{mode.policy}")
    return dataclasses.replace(mode, folder=folder)


@dataclass
class Result:
    """One streamed request, as the client saw it."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of every chunk with text
    tokens: int = 0
    error: str | None = None
    end: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, timeout: float = 600.0) -> Result:
    """Send one greedy streaming completion and time its chunks."""
    parts = urllib.parse.urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    result = Result(time.perf_counter())
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        connection.request("POST", parts.path.rstrip("/") + "/v1/completions", body,
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read()[:200].decode(errors='replace')}"
            return result
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = chunk["error"].get("message", "error")
                break
            if chunk.get("usage"):
                result.tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in chunk.get("choices", ())):
                result.chunks.append(time.perf_counter())
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()
        connection.close()
    return result


def scrape(url: str) -> dict[str, float]:
    """The server's spec-decode counters (summed over labels); empty when it has no /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30).read().decode()
    except OSError:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in SPEC_COUNTERS:
            totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def served_model(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def run_wave(url: str, model: str, prompts: list[str], concurrency: int, requests_per_client: int,
             max_tokens: int) -> dict:
    """``concurrency`` clients, each sending ``requests_per_client`` requests in turn; the wave's figures."""
    results: list[Result] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for j in range(requests_per_client):
            prompt = prompts[(index * requests_per_client + j) % len(prompts)]
            result = stream_completion(url, model, prompt, max_tokens)
            with lock:
                results.append(result)

    before = scrape(url)
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    after = scrape(url)
    return summarize(results, wall, concurrency, before, after)


def _stats(values: list[float], *quantiles: int) -> list[float | None]:
    if not values:
        return [None] * (1 + len(quantiles))
    return [float(np.mean(values))] + [float(np.percentile(values, q)) for q in quantiles]


def summarize(results: list[Result], wall: float, concurrency: int, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft_mean, ttft_p50, ttft_p90 = _stats([r.ttft for r in ok if r.ttft is not None], 50, 90)
    itl_mean, itl_p90 = _stats([b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])], 90)
    (tpot,) = _stats([(r.chunks[-1] - r.chunks[0]) / (r.tokens - 1) for r in ok if r.tokens > 1 and r.chunks])
    (per_user,) = _stats([r.tokens / (r.end - r.sent) for r in ok if r.end > r.sent])
    drafts = after.get(SPEC_COUNTERS[0], 0) - before.get(SPEC_COUNTERS[0], 0)
    accepted = after.get(SPEC_COUNTERS[1], 0) - before.get(SPEC_COUNTERS[1], 0)
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "error_examples": sorted({r.error for r in results if r.error})[:3],
            "completion_tokens": tokens, "wall_seconds": wall,
            "throughput": tokens / wall if wall else 0.0, "per_user_tokens_per_second": per_user,
            "ttft_mean": ttft_mean, "ttft_p50": ttft_p50, "ttft_p90": ttft_p90,
            "itl_mean": itl_mean, "itl_p90": itl_p90, "tpot_mean": tpot,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def run_mode(url: str, prompts: list[str], args) -> list[dict]:
    """A warm-up request, then one wave per concurrency (``args.rounds`` of them)."""
    model = warm_up(url, prompts, args)
    return [dict(run_wave(url, model, prompts, c, args.requests_per_client, args.max_tokens), round=r)
            for c in args.concurrency for r in range(rounds_of(args))]


def rounds_of(args) -> int:
    return getattr(args, "rounds", 1) or 1


def warm_up(url: str, prompts: list[str], args) -> str:
    """One short request (the first pass of every shape is slower); the served model's name."""
    model = served_model(url)
    stream_completion(url, model, prompts[0], min(args.max_tokens, 8))
    return model


def run_bench_serve(args, prompts: list[str], engine_options: dict) -> dict:
    """Every mode (or the server at ``args.url``), every concurrency: the result as JSON-ready dict.
    args.modes: resolved ``Mode``s (``resolve_mode``). engine_options: the Engine's keyword arguments
    (k, tree, limits), as the command reads them from its flags."""
    result = {"max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
              "concurrency": list(args.concurrency), "modes": {}}
    if args.url is not None:
        result["url"] = args.url
        result["modes"]["server"] = {"waves": run_mode(args.url, prompts, args)}
        return with_rounds(result, args)

    result.update(target=args.target, drafter=args.drafter, k=args.k,
                  server="in-process" if args.in_process else "own process")
    with contextlib.ExitStack() as stack:
        servers = {}
        for mode in args.modes:  # every server first, then the waves of every mode side by side
            servers[mode.label] = stack.enter_context(in_process(args, engine_options, mode) if args.in_process
                                                      else ServerProcess(args, engine_options, mode))
            result["modes"][mode.label] = {"drafter": mode.drafter, "policy": mode.policy,
                                           "startup_seconds": servers[mode.label].startup_seconds,
                                           "profile_seconds": servers[mode.label].profile_seconds, "waves": []}
        models = {mode: warm_up(server.url, prompts, args) for mode, server in servers.items()}
        for concurrency in args.concurrency:  # each concurrency: the modes one after the other
            for r in range(rounds_of(args)):  # every other round in reverse order: a drift weighs on all alike
                for mode, server in list(servers.items())[::-1 if r % 2 else 1]:
                    wave = run_wave(server.url, models[mode], prompts, concurrency, args.requests_per_client,
                                    args.max_tokens)
                    result["modes"][mode]["waves"].append(dict(wave, round=r))
    return with_rounds(result, args)


def with_rounds(result: dict, args) -> dict:
    """The result, with its rounds and their summary when there are several."""
    if rounds_of(args) > 1:
        result["rounds"] = rounds_of(args)
        result["rounds_summary"] = rounds_summary(result)
    return result


def rounds_summary(result: dict) -> list[dict]:
    """Per concurrency, each mode's median throughput and per-user speed over its rounds, and its ratio to
    the first mode's throughput in the same round (the median, and every round's)."""
    modes = list(result["modes"])
    reference = modes[0]
    summary = []
    for concurrency in result["concurrency"]:
        waves = {mode: {w["round"]: w for w in result["modes"][mode]["waves"] if w["concurrency"] == concurrency}
                 for mode in modes}
        entry = {"concurrency": concurrency, "reference": reference, "modes": {}}
        for mode in modes:
            rounds = sorted(waves[mode])
            ratios = [waves[mode][r]["throughput"] / waves[reference][r]["throughput"] for r in rounds
                      if r in waves[reference] and waves[reference][r]["throughput"] > 0]
            users = [waves[mode][r]["per_user_tokens_per_second"] for r in rounds
                     if waves[mode][r]["per_user_tokens_per_second"] is not None]
            entry["modes"][mode] = {
                "rounds": len(rounds),
                "throughput": float(np.median([waves[mode][r]["throughput"] for r in rounds])),
                "per_user_tokens_per_second": float(np.median(users)) if users else None,
                "ratio_to_reference": float(np.median(ratios)) if ratios else None,
                "ratios": [round(ratio, 4) for ratio in ratios]}
        summary.append(entry)
    return summary


@contextlib.contextmanager
def in_process(args, engine_options: dict, mode: Mode):
    """A mode's server on a thread of this process, as ``ServerProcess`` describes it."""
    from specdec.backends.target import load_target

    started = time.perf_counter()
    target = load_target(args.target, dtype=args.dtype, backend=args.backend)
    engine, _ = build_engine(target, mode.drafter, args, mode.policy, folder=mode.folder, **engine_options)
    with BackgroundServer(create_app(engine, target)) as server:
        server.startup_seconds, server.profile_seconds = time.perf_counter() - started, engine.profile_seconds
        yield server


def serve_child(args, engine_options: dict, mode: Mode, reply) -> None:
    """A server process: load, build the engine, listen on a free port, report (url, start-up, profiling)."""
    import torch

    from specdec.backends.target import load_target
    from specdec.serve.server import listen, url_of, uvicorn_server

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    target = load_target(args.target, dtype=args.dtype, backend=args.backend)
    engine, _ = build_engine(target, mode.drafter, args, mode.policy, folder=mode.folder, **engine_options)
    sock = listen("127.0.0.1", 0)
    server = uvicorn_server(create_app(engine, target))
    reply.put((url_of(sock), time.perf_counter() - started, engine.profile_seconds))
    server.run(sockets=[sock])


class ServerProcess:
    """A mode's server in a process of its own (its engine on one core, the clients on another), until
    the end of a ``with`` block; ``startup_seconds`` counts loading, the engine (profiling) and binding."""

    def __init__(self, args, engine_options: dict, mode: Mode, timeout: float = 900.0):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.reply = context.Queue()
        self.process = context.Process(target=serve_child,
                                       args=(args, engine_options, mode, self.reply), daemon=True)
        self.timeout = timeout

    def __enter__(self) -> "ServerProcess":
        import queue

        self.process.start()
        try:
            self.url, self.startup_seconds, self.profile_seconds = self.reply.get(timeout=self.timeout)
        except queue.Empty:
            self.__exit__()
            raise RuntimeError("the server process did not start") from None
        deadline = time.monotonic() + 60
        while True:  # listening: wait until the app answers
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5).read()
                return self
            except OSError:
                if time.monotonic() > deadline or not self.process.is_alive():
                    self.__exit__()
                    raise RuntimeError("the server process does not answer") from None
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.join(15)


def format_table(result: dict) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    width = max([11] + [len(mode) for mode in result["modes"]])
    header = (f"{'mode':<{width}} {'conc':>4} {'reqs':>4} {'err':>3} {'tok/s':>8} {'user tok/s':>10} {'TTFT ms':>8} "
              f"{'p50':>7} {'p90':>7} {'ITL ms':>7} {'p90':>7} {'TPOT ms':>7} {'accept':>6}")
    lines = [header, "-" * len(header)]
    for mode, entry in result["modes"].items():
        for w in entry["waves"]:
            ms = lambda v: None if v is None else 1e3 * v  # noqa: E731
            lines.append(f"{mode:<{width}} {w['concurrency']:>4} {w['requests']:>4} {w['errors']:>3} "
                         f"{cell(w['throughput'], '8.1f')} {cell(w['per_user_tokens_per_second'], '10.1f')} "
                         f"{cell(ms(w['ttft_mean']), '8.1f')} {cell(ms(w['ttft_p50']), '7.1f')} "
                         f"{cell(ms(w['ttft_p90']), '7.1f')} {cell(ms(w['itl_mean']), '7.1f')} "
                         f"{cell(ms(w['itl_p90']), '7.1f')} {cell(ms(w['tpot_mean']), '7.1f')} "
                         f"{cell(w['mean_acceptance_length'], '6.2f')}")
    startups = [f"{mode} {entry['startup_seconds']:.1f} s" + (f" (profiling {entry['profile_seconds']:.1f} s)"
                                                               if entry.get("profile_seconds") else "")
                for mode, entry in result["modes"].items() if "startup_seconds" in entry]
    if startups:
        lines.append("server start-up: " + ", ".join(startups))
    if result.get("rounds_summary"):
        reference = result["rounds_summary"][0]["reference"]
        lines += ["", f"median of {result['rounds']} rounds (the modes' order reversed every other round); "
                      f"x {reference}: the median of each round's ratio, then every round's",
                  f"{'mode':<{width}} {'conc':>4} {'tok/s':>8} {'user tok/s':>10} {'x ' + reference:>10}  rounds"]
        for entry in result["rounds_summary"]:
            for mode, m in entry["modes"].items():
                lines.append(f"{mode:<{width}} {entry['concurrency']:>4} {cell(m['throughput'], '8.1f')} "
                             f"{cell(m['per_user_tokens_per_second'], '10.1f')} "
                             f"{cell(m['ratio_to_reference'], '10.3f')}  "
                             + " ".join(f"{ratio:.3f}" for ratio in m["ratios"]))
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    """Total throughput against concurrency (log2 axis), one line per mode; written atomically."""
    import os
    import tempfile
    from pathlib import Path

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for mode, entry in result["modes"].items():
        by_concurrency: dict[int, list[float]] = {}
        for w in entry["waves"]:  # several rounds: their median
            by_concurrency.setdefault(w["concurrency"], []).append(w["throughput"])
        concurrency = sorted(by_concurrency)
        axes.plot(concurrency, [float(np.median(by_concurrency[c])) for c in concurrency], marker="o", label=mode)
    axes.set_xscale("log", base=2)
    concurrency = sorted({w["concurrency"] for entry in result["modes"].values() for w in entry["waves"]})
    axes.set_xticks(concurrency, [str(c) for c in concurrency])
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("total throughput (tokens/s)")
    axes.set_title(f"specdec serve, max_tokens {result['max_tokens']}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(handle)
    try:
        figure.savefig(temporary, dpi=120, bbox_inches="tight")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    finally:
        plt.close(figure)
