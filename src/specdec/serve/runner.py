"""The engine thread: steps the engine while it has work and hands each update to its request's asyncio queue;
and ``build_engine``, the engine a server runs.

The engine is stepped from this one thread only; requests are added and cancelled from the event loop
(``Engine.add`` and ``Engine.cancel`` are thread-safe). An exception in a step ends the thread: the runner
is then dead, every pending request receives ``EngineDied`` and new requests are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid

log = logging.getLogger("specdec.serve")


class EngineDied(Exception):
    """The engine thread stopped on an error; the request cannot finish."""


class EngineRunner:
    """Drives an ``Engine`` from a thread of its own."""

    def __init__(self, engine):
        self.engine = engine
        self.error: BaseException | None = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._paused = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def start(self) -> EngineRunner:
        if not self._thread.is_alive() and not self._stopping:
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def pause(self) -> None:
        """Take no more steps until ``resume`` (requests still queue up): tests and drains."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    def submit(self, request) -> tuple[str, asyncio.Queue]:
        """Add a request to the engine; its updates arrive on the returned queue of the calling event loop.
        The engine's own refusals (queue full, too long) propagate."""
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:  # registered before the engine thread can dispatch an update for it
            if not self.alive:
                raise EngineDied(self.reason())
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add(dataclasses.replace(request, request_id=request_id))
        except BaseException:
            with self._lock:
                self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return request_id, queue

    def cancel(self, request_id: str) -> None:
        """Cancel a request that has not finished; its last update ("cancelled") still follows."""
        with self._lock:
            pending = request_id in self._queues
        if pending and self.alive:
            self.engine.cancel(request_id)
            self._wake.set()

    def reason(self) -> str:
        """Why the runner takes no requests (when it does not)."""
        if self.error is not None:
            return f"the engine stopped on an error ({type(self.error).__name__}: {self.error})"
        return "the engine is not running"

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                if self._paused or not self.engine.has_work:
                    self._wake.wait()
                    continue
                self._dispatch(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - any failure ends the engine, reported to every request
            log.exception("the engine thread stopped")
            with self._lock:
                self.error = exc
                pending, self._queues = list(self._queues.values()), {}
            died = EngineDied(self.reason())
            for loop, queue in pending:
                self._post(loop, queue, died)

    def _dispatch(self, updates) -> None:
        with self._lock:
            targets = []
            for update in updates:
                entry = self._queues.get(update.request_id)
                if entry is None:
                    continue
                if update.finish_reason is not None:
                    del self._queues[update.request_id]
                targets.append((entry, update))
        for (loop, queue), update in targets:
            self._post(loop, queue, update)

    @staticmethod
    def _post(loop, queue, item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting
            pass


def build_engine(target, drafter: str, options, policy: str | None = None, folder: str | None = None,
                 **engine_options):
    """An engine on ``target`` with a freshly built drafter (a registry name, built from the ``options``
    namespace: --draft, n-gram sizes, ...); (engine, seconds it took). ``policy``: schedule.parse_policy's
    text; ``folder``: the drafter's folder in place of --draft."""
    from specdec.drafters.registry import build
    from specdec.engine import Engine
    from specdec.schedule import parse_policy

    started = time.perf_counter()
    if drafter == "none":
        engine = Engine(target, None, **engine_options)
    else:
        built = build(drafter, folder or getattr(options, "draft", None), options)
        if hasattr(built, "check_compatible"):
            built.check_compatible(target)
        engine = Engine(target, built, policy=parse_policy(policy) if policy else None, **engine_options)
    return engine, time.perf_counter() - started
