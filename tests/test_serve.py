"""`specdec serve` through the official openai client: routes, streaming, log-probabilities, errors,
metrics, exactness under concurrent load with speculation, cancellation and a full queue."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from specdec import generate
from specdec.backends.target import load_target
from specdec.drafters import PromptLookup
from specdec.engine import Engine
from specdec.serve import BackgroundServer, create_app
from specdec.serve.text import TextStream
from specdec.zoo import zoo_path

PROMPTS = ["def add(a, b):\n", "class Stack:\n    def __init__(self):\n", "import os\nimport sys\n\n\ndef main(",
           "for i in range(10):\n    print(", "x = [1, 2, 3]\ny = ", "def read(path):\n    with open(path) as f:\n"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def target():
    return load_target(zoo_path("target"))


def serve(target, chat_template=None, **engine_options):
    engine = Engine(target, PromptLookup(), num_draft_tokens=4, **engine_options)
    return BackgroundServer(create_app(engine, target, "zoo", chat_template))


@pytest.fixture(scope="module")
def server(target):
    with serve(target, CHAT_TEMPLATE) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def engine_of(server):
    return server.app.state.server.engine


def solo(target, prompt, max_tokens):
    return target.decode(generate(target, [prompt], max_new_tokens=max_tokens).token_ids[0])


def post(url, body: bytes):
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_completion_matches_plain_decoding(client, target):
    out = client.completions.create(model="zoo", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.choices[0].text == solo(target, PROMPTS[0], 12)
    assert out.usage.prompt_tokens == len(target.encode([PROMPTS[0]])[0])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.choices[0].finish_reason in ("length", "stop")


def test_token_id_prompt_and_spec_decode_usage(client, target):
    ids = target.encode([PROMPTS[1]])[0]
    out = client.completions.create(model="zoo", prompt=ids, max_tokens=10, temperature=0,
                                    extra_body={"spec_decode_stats": True})
    assert out.choices[0].text == solo(target, PROMPTS[1], 10)
    spec = out.usage.model_extra["spec_decode"]
    assert spec["drafts"] >= 1 and spec["draft_tokens"] >= spec["accepted_tokens"] >= 0
    assert spec["mean_acceptance_length"] >= 1


def test_streaming_concatenates_to_the_text(client):
    full = client.completions.create(model="zoo", prompt=PROMPTS[2], max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="zoo", prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_stop_string_cuts_the_text(client, target):
    text = solo(target, PROMPTS[0], 12)
    stop = text[3:5]
    out = client.completions.create(model="zoo", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="zoo", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_logprobs_are_the_targets(client, target):
    out = client.completions.create(model="zoo", prompt=PROMPTS[3], max_tokens=8, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    prompt = target.encode([PROMPTS[3]])[0]
    generated = generate(target, [prompt], max_new_tokens=8).token_ids[0]
    ids = torch.tensor([prompt + generated])
    cache = target.new_cache(1)
    with torch.inference_mode():
        logits = target.forward(cache, ids, logits_to_keep=ids.shape[1])[0]
    expected = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1)
    expected = expected.gather(-1, torch.tensor(generated)[:, None])[:, 0]
    assert len(lp.token_logprobs) == len(generated)
    assert torch.allclose(torch.tensor(lp.token_logprobs), expected, atol=1e-4)
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0


def test_chat(client, target):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    out = client.chat.completions.create(model="zoo", messages=messages, max_tokens=10, temperature=0,
                                         logprobs=True)
    rendered = "user: def add(a, b):\nassistant:"
    assert out.choices[0].message.content == solo(target, rendered, 10)
    assert out.choices[0].message.role == "assistant"
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="zoo", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content


def test_chat_without_template_is_refused(target):
    with serve(target) as running:
        plain = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="chat template"):
            plain.chat.completions.create(model="zoo", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("options, param", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                            ({"max_tokens": 0}, "max_tokens"), ({"n": 2}, "n"),
                                            ({"echo": True}, "echo"), ({"logprobs": 3}, "logprobs"),
                                            ({"max_tokens": 5000}, "max_tokens")])
def test_bad_parameters_are_named(client, options, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="zoo", prompt="x = ", **options)
    assert error.value.status_code == 400 and error.value.body["param"] == param


def test_errors(client, server):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt="x")
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="zoo", prompt="x " * 3000, max_tokens=4)
    assert error.value.body["param"] == "prompt"
    status, body = post(server.url + "/v1/completions", b'{"prompt": "x", ')
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post(server.url + "/v1/completions", b'[1, 2]')
    assert status == 400 and "error" in body
    status, body = post(server.url + "/v1/nowhere", b'{}')
    assert status == 404 and "error" in body


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["zoo"]
    assert urllib.request.urlopen(server.url + "/health").status == 200

    def counters():
        text = urllib.request.urlopen(server.url + "/metrics").read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("vllm:spec_decode") and "_total" in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return text, values

    before_text, before = counters()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds", "vllm:num_requests_running"):
        assert name in before_text
    client.completions.create(model="zoo", prompt=PROMPTS[4] * 3, max_tokens=16, temperature=0)
    after_text, after = counters()
    drafts = 'vllm:spec_decode_num_drafts_total{model_name="zoo"}'
    assert after[drafts] > before.get(drafts, 0)
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="zoo",position="0"}' in after_text


def test_concurrent_load_is_exact(server, target):
    """64 concurrent greedy requests with speculation: no errors, each equal to its own plain decoding."""
    clients = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 8 + i % 9) for i in range(64)]

    def ask(job):
        prompt, max_tokens = job
        return clients.completions.create(model="zoo", prompt=prompt, max_tokens=max_tokens,
                                          temperature=0).choices[0].text

    with ThreadPoolExecutor(64) as pool:
        texts = list(pool.map(ask, jobs))
    expected = {job: solo(target, *job) for job in set(jobs)}
    assert texts == [expected[job] for job in jobs]


def test_disconnect_mid_stream_frees_memory(server, client):
    engine = engine_of(server)
    stream = client.completions.create(model="zoo", prompt=PROMPTS[5], max_tokens=1500, temperature=0, stream=True)
    for _, chunk in zip(range(2), stream):
        pass
    assert engine.metrics.running == 1
    stream.close()
    deadline = time.monotonic() + 20
    while (engine.metrics.kv_tokens_reserved or engine.metrics.running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.metrics.kv_tokens_reserved == 0 and engine.metrics.running == 0


def test_full_queue_is_503_and_a_dead_engine_is_500(target):
    with serve(target, max_queue=1) as running:
        runner = running.app.state.server.runner
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        runner.pause()  # nothing is admitted: the first request waits in the queue, the second finds it full
        first = {}
        waiting = threading.Thread(target=lambda: first.update(
            out=client.completions.create(model="zoo", prompt="x = ", max_tokens=2, temperature=0)))
        waiting.start()
        deadline = time.monotonic() + 10
        while not runner.engine.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as error:
            client.completions.create(model="zoo", prompt="y = ", max_tokens=2)
        assert error.value.status_code == 503 and error.value.body["code"] == "queue_full"
        runner.resume()
        waiting.join(30)
        assert first["out"].choices[0].text == solo(target, "x = ", 2)

        def broken():
            raise RuntimeError("boom")
        runner.engine.step = broken
        with pytest.raises(openai.InternalServerError) as error:
            client.completions.create(model="zoo", prompt="x = ", max_tokens=2)
        assert error.value.status_code == 500 and "Traceback" not in error.value.message
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(running.url + "/health")
        assert health.value.code == 503


def test_text_stream_holds_back_stop_prefixes():
    pieces = {1: "ab", 2: "c", 3: "XY", 4: "Z", 5: "d"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), ["XYZ"])
    assert stream.add([1]) == "ab"
    assert stream.add([2, 3]) == "c"       # "XY" may start the stop string
    assert stream.add([4]) == "" and stream.stopped
    assert stream.flush() == ""
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), ["XYQ"])
    assert stream.add([1, 3]) == "ab" and stream.add([5]) == "XYd" and stream.flush() == ""


@pytest.mark.parametrize("argv", [["--speculative-config", '{"method": "ngram", "bogus": 1}'],
                                  ["--num-speculative-tokens-per-batch-size", "1-4"], ["--drafter", "nope"]])
def test_bad_serve_flags_fail_in_one_line(capsys, argv):
    from specdec.commands.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_serve_refuses_a_busy_port_in_one_line(capsys, server):
    from specdec.commands.cli import main

    port = server.url.rsplit(":", 1)[1]
    assert main(["serve", "--port", port, "--drafter", "prompt-lookup", "--policy", "fixed"]) == 2
    assert "cannot listen" in capsys.readouterr().err


def test_speculative_config_maps_to_the_drafter_flags():
    from specdec.commands.cli import build_parser
    from specdec.commands.serve import engine_options, resolve_models

    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    args = build_parser().parse_args(["serve", "--speculative-config", config, "--max-kv-tokens", "4096"])
    resolve_models(args)
    assert (args.drafter, args.k, args.max_ngram, args.min_ngram) == ("prompt-lookup", 3, 4, 2)
    assert args.target == str(zoo_path("target"))
    assert engine_options(args)["num_draft_tokens"] == 3 and engine_options(args)["max_kv_tokens"] == 4096
    args = build_parser().parse_args(["serve", "--speculative-algorithm", "STANDALONE",
                                      "--num-speculative-tokens-per-batch-size", "1:4,8:2,32:0"])
    resolve_models(args)
    assert args.draft == str(zoo_path("draft")) and args.per_batch_size == "static:1=4,8=2,32=0"


def test_serve_takes_the_drafter_trained_for_a_named_real_target(tmp_path):
    """`serve --target smollm2-135m --drafter eagle3` serves with smollm2-135m's own EAGLE-3 folder (resolved
    by name, nothing fetched); a target the zoo trained nothing for needs --draft, in one line."""
    from specdec.commands.cli import build_parser
    from specdec.commands.serve import resolve_models
    from specdec.errors import InvalidArgumentError
    from specdec.zoo import data_dir

    args = build_parser().parse_args(["serve", "--target", "smollm2-135m", "--drafter", "eagle3"])
    resolve_models(args)
    assert args.draft == str(data_dir() / "smollm2-135m" / "eagle3")
    args = build_parser().parse_args(["serve", "--target", str(tmp_path), "--drafter", "eagle3"])
    with pytest.raises(InvalidArgumentError, match="needs --draft DIR"):
        resolve_models(args)
