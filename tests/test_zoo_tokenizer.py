"""Tokenizer: lossless round trip on source code, special tokens, HF loading."""

import pytest
from transformers import AutoTokenizer

from specdec.zoo import corpus, default_tokenizer_dir
from specdec.zoo import tokenizer as zt

SAMPLE = 'def f(x, *, y=None):\n\t"""Tabs, café, emoji 🐍, trailing  spaces  """\n    return {x: y}  \r\n\n'


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    texts = corpus.read_split("validation")[:6]
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    zt.save_tokenizer(zt.train_tokenizer(texts, vocab_size=400), out)
    return out


def test_special_tokens_and_auto_tokenizer(small_dir):
    tok = AutoTokenizer.from_pretrained(small_dir)
    assert tok.eos_token == zt.EOS_TOKEN and tok.pad_token == zt.PAD_TOKEN and tok.mask_token == zt.MASK_TOKEN
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 2)
    assert tok("x = 1")["input_ids"][-1] != tok.eos_token_id  # no automatic eos
    assert tok(zt.EOS_TOKEN)["input_ids"] == [0]


def test_round_trip_small(small_dir):
    tok = AutoTokenizer.from_pretrained(small_dir)
    for text in [SAMPLE, "", " leading space", "\n\n\n", "x" * 300]:
        assert tok.decode(tok(text)["input_ids"]) == text


def test_zoo_tokenizer_round_trips_held_out_code():
    directory = default_tokenizer_dir()
    if not (directory / "tokenizer.json").is_file():
        pytest.fail(f"zoo tokenizer missing at {directory}; run `specdec zoo build`")
    tok = AutoTokenizer.from_pretrained(directory)
    assert len(tok) == zt.DEFAULT_VOCAB_SIZE
    raw = zt.load_tokenizer(directory)
    for text in corpus.read_split("test")[:8] + [SAMPLE]:
        assert raw.decode(raw.encode(text).ids, skip_special_tokens=False) == text
        assert tok.decode(tok(text)["input_ids"]) == text


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(zt.TokenizerError, match="no tokenizer.json"):
        zt.load_tokenizer(tmp_path)
