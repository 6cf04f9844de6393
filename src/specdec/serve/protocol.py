"""The OpenAI request bodies the server accepts, validated into what the engine needs.

Every refusal is an ``APIError`` naming the parameter at fault, so clients get OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) and never a traceback. Fields the server does not
know are ignored; fields it knows but cannot honour (``n`` > 1, ``echo``, penalties, top log-probabilities)
are refused rather than silently dropped.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from specdec.sampling import SamplingConfig

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error the client is told about, as OpenAI words it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class Params:
    """One request's generation settings, checked."""

    prompt: str | list[int]           # completions: the text or token ids; chat: the rendered messages
    max_tokens: int | None            # None: up to the context window (chat's default)
    sampling: SamplingConfig
    seed: int
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False       # stream_options.include_usage: a last chunk with the usage
    logprobs: bool = False
    spec_decode_stats: bool = False   # the extra field "spec_decode_stats": usage.spec_decode


def _number(body: dict, name: str, default, kind=float):
    value = body.get(name)
    if value is None:
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (kind is int and not float(value).is_integer()):
        raise invalid(name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be true or false, got {value!r}")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "stop must be a string or a list of strings")
    if len(stops) > 4:
        raise invalid("stop", f"at most 4 stop strings, got {len(stops)}")
    return [s for s in stops if s]


def _common(body: dict, prompt, max_tokens_names: tuple[str, ...], default_max_tokens: int | None) -> Params:
    """The fields completions and chat share: sampling, limits, stop strings, streaming."""
    n = _number(body, "n", 1, int)
    if n != 1:
        raise invalid("n", f"only n = 1 is supported, got {n}")
    best_of = _number(body, "best_of", 1, int)
    if best_of != 1:
        raise invalid("best_of", f"only best_of = 1 is supported, got {best_of}")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0):
            raise invalid(name, f"{name} is not supported (it would change the distribution); leave it 0")
    if body.get("logit_bias"):
        raise invalid("logit_bias", "logit_bias is not supported")

    max_tokens = default_max_tokens
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _number(body, name, None, int)
            if max_tokens < 1:
                raise invalid(name, f"{name} must be >= 1, got {max_tokens}")
            break
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise invalid("temperature", f"temperature must be in [0, 2], got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = _number(body, "top_k", None, int)
    if top_k is not None and top_k < -1:
        raise invalid("top_k", f"top_k must be >= 1 (0 or -1: no limit), got {top_k}")
    seed = _number(body, "seed", None, int)
    if seed is None:
        seed = secrets.randbelow(2 ** 31)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise invalid("stream_options", "stream_options must be an object")
    return Params(prompt=prompt, max_tokens=max_tokens,
                  sampling=SamplingConfig(temperature, top_k if top_k and top_k > 0 else None,
                                          top_p if top_p < 1.0 else None),
                  seed=seed, stop=_stop(body), stream=_flag(body, "stream"),
                  include_usage=_flag(stream_options, "include_usage"),
                  spec_decode_stats=_flag(body, "spec_decode_stats"))


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def parse_completion(body: dict) -> Params:
    """A /v1/completions body: one prompt (a string, a list of one string, token ids or a list of one such list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_ids(prompt[0])):
        prompt = prompt[0]
    if not (isinstance(prompt, str) or _is_token_ids(prompt)):
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise invalid("prompt", "only one prompt per request is supported")
        raise invalid("prompt", "prompt must be a string or a list of token ids")
    if not prompt:
        raise invalid("prompt", "the prompt is empty")
    if _flag(body, "echo"):
        raise invalid("echo", "echo is not supported")
    if body.get("suffix"):
        raise invalid("suffix", "suffix is not supported")
    params = _common(body, prompt, ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS)
    logprobs = _number(body, "logprobs", None, int)
    if logprobs is not None and logprobs != 0:
        raise invalid("logprobs", "only the chosen token's log-probability is available: logprobs must be 0 "
                                  f"or null, got {logprobs}")
    params.logprobs = logprobs is not None
    return params


def message_text(content, index: int) -> str:
    """A message's content: a string, or OpenAI's list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid("messages", f"messages[{index}].content must be a string or a list of text parts")


def parse_messages(body: dict) -> list[dict]:
    """The chat messages, each {"role", "content": str} (other keys kept for the template)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid("messages", f"messages[{index}] must be an object with a role")
        parsed.append({**message, "content": message_text(message.get("content", ""), index)})
    return parsed


def parse_chat(body: dict, rendered_prompt: str) -> Params:
    """A /v1/chat/completions body, its messages already rendered by the chat template."""
    params = _common(body, rendered_prompt, ("max_completion_tokens", "max_tokens"), None)
    params.logprobs = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", None, int)
    if top:
        raise invalid("top_logprobs", "only the chosen token's log-probability is available: top_logprobs "
                                      f"must be 0 or null, got {top}")
    return params
