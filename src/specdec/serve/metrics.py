"""Prometheus metrics under vLLM's names, so its dashboards and scrapers read a specdec server unchanged.

Each server has its own registry (several apps can live in one process). The speculative-decoding counters
follow the engine's cumulative counts, synced as deltas at every scrape; request counts and latencies are
observed by the server as requests finish. prometheus_client adds ``_total`` to counters, as vLLM's
exposition has it.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class ServerMetrics:
    """The server's metrics for one engine and one served model name."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.registry = registry = CollectorRegistry()
        label = {"model_name": model_name}
        names = ["model_name"]

        def counter(name, doc, extra=()):
            metric = Counter(name, doc, names + list(extra), registry=registry)
            return metric if extra else metric.labels(**label)

        def gauge(name, doc):
            return Gauge(name, doc, names, registry=registry).labels(**label)

        def histogram(name, doc):
            return Histogram(name, doc, names, buckets=LATENCY_BUCKETS, registry=registry).labels(**label)

        self._label = label
        self.drafts = counter("vllm:spec_decode_num_drafts", "Speculative steps that verified drafts")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ("position",))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated for finished requests")
        self.request_success = counter("vllm:request_success", "Requests finished", ("finished_reason",))
        self.request_errors = counter("specdec:request_errors", "Requests refused or failed", ("status",))
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for admission")
        self.kv_reserved = gauge("specdec:kv_tokens_reserved", "KV-cache tokens reserved by admitted requests")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of the KV budget reserved (0 when unlimited)")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between tokens (a step's gap shared by the tokens it produced)")
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Per request: (end - first token) / (tokens - 1)")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token")
        self._seen = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": []}
        self._lock = threading.Lock()

    def sync(self) -> None:
        """Bring the counters up to the engine's cumulative counts and the gauges to its current state."""
        m = self.engine.metrics
        with self._lock:
            seen = self._seen
            for name, metric in (("drafts", self.drafts), ("draft_tokens", self.draft_tokens),
                                 ("accepted_tokens", self.accepted_tokens)):
                value = int(getattr(m, f"num_{name}"))
                if value > seen[name]:
                    metric.inc(value - seen[name])
                seen[name] = value
            per_pos = list(m.accepted_per_pos)
            for position, value in enumerate(per_pos):
                before = seen["per_pos"][position] if position < len(seen["per_pos"]) else 0
                child = self.accepted_per_pos.labels(position=str(position), **self._label)
                if value > before:
                    child.inc(value - before)
            seen["per_pos"] = per_pos
            self.running.set(m.running)
            self.waiting.set(m.waiting)
            self.kv_reserved.set(m.kv_tokens_reserved)
            budget = m.kv_tokens_budget
            self.kv_usage.set(m.kv_tokens_reserved / budget if budget else 0.0)

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, ttft: float | None,
                 gaps: list[tuple[float, int]], e2e: float) -> None:
        """A request's end: its counts and latencies (``gaps``: (seconds since the previous tokens, tokens))."""
        self.request_success.labels(finished_reason=finish_reason, **self._label).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))
        for seconds, tokens in gaps:
            for _ in range(tokens):
                self.itl.observe(seconds / tokens)

    def error(self, status: int) -> None:
        self.request_errors.labels(status=str(status), **self._label).inc()

    def exposition(self) -> bytes:
        self.sync()
        return generate_latest(self.registry)
