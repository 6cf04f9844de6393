"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.

``create_app(engine, target)`` serves one engine; its thread starts and stops with the app. Every error
reaches the client in OpenAI's shape (``{"error": {...}}``), never as a traceback or FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import SpecdecError
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import APIError, Params, invalid, parse_chat, parse_completion, parse_messages
from specdec.serve.runner import EngineDied, EngineRunner
from specdec.serve.text import TextStream

log = logging.getLogger("specdec.serve")
DISCONNECT_POLL_SECONDS = 0.5  # how often a waiting request checks that its client is still there
NO_WINDOW_MAX_TOKENS = 256     # chat's default max_tokens when the model states no context window


@dataclass
class Piece:
    """What one engine update adds to a response."""

    text: str
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None


class Server:
    """What the routes share: the engine's runner, the target, the served name, the metrics."""

    def __init__(self, engine, target, model_name: str | None = None, chat_template: str | None = None,
                 runner: EngineRunner | None = None):
        self.engine = engine
        self.target = target
        self.model_name = model_name or Path(str(target.name)).name
        self.chat_template = chat_template or target.chat_template
        self.runner = runner or EngineRunner(engine)
        self.metrics = ServerMetrics(engine, self.model_name)
        self.created = int(time.time())

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def render_chat(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise invalid("messages", f"the model {self.model_name} has no chat template; use /v1/completions, "
                                      "or start the server with --chat-template FILE")
        try:
            return self.target.render_chat(messages, self.chat_template)
        except SpecdecError as exc:
            raise invalid("messages", str(exc)) from None

    def encode(self, prompt, param: str) -> list[int]:
        try:
            return self.target.encode([prompt])[0]
        except SpecdecError as exc:
            raise invalid(param, str(exc)) from None

    def max_tokens(self, params: Params, prompt_tokens: int, param: str) -> int:
        """The request's token limit, checked against the context window."""
        window = self.target.max_positions
        if window is not None and prompt_tokens >= window:
            raise APIError(400, f"This model's maximum context length is {window} tokens; the prompt has "
                                f"{prompt_tokens}.", param=param, code="context_length_exceeded")
        if params.max_tokens is None:
            return window - prompt_tokens if window is not None else NO_WINDOW_MAX_TOKENS
        if window is not None and prompt_tokens + params.max_tokens > window:
            raise APIError(400, f"This model's maximum context length is {window} tokens; {prompt_tokens} in the "
                                f"prompt plus max_tokens {params.max_tokens} exceed it.", param="max_tokens",
                           code="context_length_exceeded")
        return params.max_tokens


class Generation:
    """One request on the engine: its updates as pieces of text, its timings, its cancellation."""

    def __init__(self, server: Server, http: Request, prompt: list[int], max_tokens: int, params: Params,
                 param: str):
        from specdec.engine import QueueFullError, Request as EngineRequest
        from specdec.errors import ContextLengthError, InvalidArgumentError

        self.server, self.http, self.params = server, http, params
        self.prompt_tokens = len(prompt)
        self.stream = TextStream(server.target.decode, params.stop)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stats = None
        self.done = False
        self.arrival = time.perf_counter()
        self.first: float | None = None
        self.last = self.arrival
        self.gaps: list[tuple[float, int]] = []
        request = EngineRequest(prompt=prompt, max_new_tokens=max_tokens, sampling=params.sampling,
                                seed=params.seed, logprobs=params.logprobs)
        try:
            self.request_id, self.queue = server.runner.submit(request)
        except QueueFullError as exc:
            raise APIError(503, f"the server is busy (its queue is full); retry later ({exc})",
                           code="queue_full") from None
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except InvalidArgumentError as exc:
            raise invalid(None, str(exc)) from None
        except EngineDied as exc:
            raise APIError(503, str(exc), code="engine_stopped") from None

    async def _next(self):
        """The next update, or None once the client has gone."""
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await self.http.is_disconnected():
                    return None
                continue
            if isinstance(item, EngineDied):
                raise APIError(500, str(item), code="engine_error")
            return item

    def _take(self, tokens: list[int], logprobs):
        """The text these tokens release; with stop strings, the tokens up to the one completing one."""
        if not self.params.stop:
            return self.stream.add(tokens), tokens, logprobs
        text = ""
        for i, token in enumerate(tokens):
            text += self.stream.add([token])
            if self.stream.stopped:
                return text, tokens[: i + 1], None if logprobs is None else logprobs[: i + 1]
        return text, tokens, logprobs

    async def pieces(self):
        """The response's pieces, the last one with its finish reason."""
        try:
            while True:
                update = await self._next()
                if update is None:
                    return
                text, tokens, logprobs = "", [], None
                if not self.stream.stopped and update.tokens:
                    text, tokens, logprobs = self._take(list(update.tokens), update.logprobs)
                    self._timing(len(tokens))
                    if self.stream.stopped and update.finish_reason is None:
                        self.server.runner.cancel(self.request_id)  # free its memory now; drain to its end
                if update.finish_reason is not None:
                    self.done = True
                    self.stats = update.stats
                    self.finish_reason = "stop" if self.stream.stopped else update.finish_reason
                    yield Piece(text + self.stream.flush(), tokens, logprobs, self.finish_reason)
                    return
                if text or tokens:
                    yield Piece(text, tokens, logprobs)
        finally:
            if not self.done:
                self.server.runner.cancel(self.request_id)
            self.server.metrics.finished(self.finish_reason or "abort", self.prompt_tokens, self.completion_tokens,
                                         None if self.first is None else self.first - self.arrival, self.gaps,
                                         time.perf_counter() - self.arrival)

    def _timing(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append((now - self.last, tokens))
        self.last = now
        self.completion_tokens += tokens

    def usage(self) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.params.spec_decode_stats:
            s = self.stats
            usage["spec_decode"] = None if s is None else {
                "mean_acceptance_length": s.mean_acceptance_length, "drafts": s.drafts,
                "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens, "steps": s.steps}
        return usage


class Shape:
    """How one endpoint words its responses: completions or chat."""

    def __init__(self, server: Server, chat: bool):
        self.server, self.chat = server, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.offset = 0  # completions' text_offset across chunks

    def logprobs(self, tokens: list[int], logprobs: list[float] | None):
        if logprobs is None:
            return None
        strings = [self.server.target.decode([t]) or "" for t in tokens]
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                                for s, lp in zip(strings, logprobs)]}
        offsets = []
        for s in strings:
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": strings, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}

    def envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.server.model_name,
                "choices": choices}

    def choice(self, text: str, logprobs, finish_reason, chunk: bool, first: bool = False) -> dict:
        choice = {"index": 0}
        if not self.chat:
            choice["text"] = text
        elif chunk:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return choice


def sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


async def respond(server: Server, http: Request, generation: Generation, shape: Shape):
    """The response to a started generation: one JSON body, or a server-sent event stream."""
    params = generation.params
    if not params.stream:
        texts, tokens, logprobs, finish = [], [], [], None
        async with contextlib.aclosing(generation.pieces()) as pieces:
            async for piece in pieces:
                texts.append(piece.text)
                tokens += piece.tokens
                logprobs += piece.logprobs or []
                finish = piece.finish_reason
        if finish is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        lp = shape.logprobs(tokens, logprobs) if params.logprobs else None
        body = shape.envelope([shape.choice("".join(texts), lp, finish, chunk=False)], chunk=False)
        body["usage"] = generation.usage()
        return JSONResponse(body)

    async def events():
        first = True
        try:
            async with contextlib.aclosing(generation.pieces()) as pieces:
                async for piece in pieces:
                    lp = shape.logprobs(piece.tokens, piece.logprobs) if params.logprobs else None
                    if piece.text or lp or piece.finish_reason or first:
                        yield sse(shape.envelope([shape.choice(piece.text, lp, piece.finish_reason, chunk=True,
                                                               first=first)], chunk=True))
                        first = False
            if params.include_usage and generation.done:
                yield sse(shape.envelope([], chunk=True) | {"usage": generation.usage()})
        except APIError as exc:
            server.metrics.error(exc.status)
            yield sse(exc.body())
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def read_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(None, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    return body


def create_app(engine, target, model_name: str | None = None, chat_template: str | None = None) -> FastAPI:
    """The app serving ``engine`` (on ``target``) as ``model_name`` (default: the target folder's name)."""
    server = Server(engine, target, model_name, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.runner.start()
        try:
            yield
        finally:
            server.runner.stop()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        server.metrics.error(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return await api_error(request, invalid(None, f"invalid request: {exc.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return await api_error(request, APIError(exc.status_code, str(exc.detail),
                                                 code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return await api_error(request, APIError(500, f"internal server error ({type(exc).__name__})",
                                                 code="internal_error"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        server.check_model(body)
        params = parse_completion(body)
        prompt = server.encode(params.prompt, "prompt")
        max_tokens = server.max_tokens(params, len(prompt), "prompt")
        generation = Generation(server, request, prompt, max_tokens, params, "prompt")
        return await respond(server, request, generation, Shape(server, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        server.check_model(body)
        rendered = server.render_chat(parse_messages(body))
        params = parse_chat(body, rendered)
        prompt = server.encode(rendered, "messages")
        max_tokens = server.max_tokens(params, len(prompt), "messages")
        generation = Generation(server, request, prompt, max_tokens, params, "messages")
        return await respond(server, request, generation, Shape(server, chat=True))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "specdec", "max_model_len": target.max_positions}]}

    @app.get("/health")
    async def health():
        if server.runner.alive:
            return {"status": "ok"}
        return JSONResponse(APIError(503, server.runner.reason(), code="engine_stopped").body(), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=server.metrics.content_type)

    return app
