"""Byte-level BPE tokenizer for the zoo, trained on the corpus train split only.

Byte-level pre-tokenization without prefix spaces and a byte-level decoder make
``decode(encode(text)) == text`` for any UTF-8 text, which the lossless
decoding tests rely on. Files are saved in the standard Hugging Face layout so
``transformers.AutoTokenizer.from_pretrained(dir)`` loads them offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdec.errors import SpecdecError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
DEFAULT_VOCAB_SIZE = 4096


class TokenizerError(SpecdecError):
    """A tokenizer directory is missing or unusable."""


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE; special tokens get ids 0, 1, 2 in SPECIAL_TOKENS order."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int = 2048) -> Path:
    """Write tokenizer.json + tokenizer_config.json atomically into ``out_dir``."""
    from specdec.models.files import replaced_dir

    with replaced_dir(out_dir) as work:
        write_tokenizer_files(tokenizer, work, model_max_length)
    return Path(out_dir)


def write_tokenizer_files(tokenizer: Tokenizer, directory: Path, model_max_length: int = 2048) -> None:
    """Write the HF tokenizer files into an existing directory (not atomic by itself)."""
    directory = Path(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": EOS_TOKEN,
        "unk_token": None,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def load_tokenizer(directory: Path) -> Tokenizer:
    """Load the raw ``tokenizers`` object saved by :func:`save_tokenizer`."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"no tokenizer.json in {directory}")
    return Tokenizer.from_file(str(path))


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of the eos / pad / mask tokens."""
    ids = {name: tokenizer.token_to_id(tok) for name, tok in (("eos", EOS_TOKEN), ("pad", PAD_TOKEN), ("mask", MASK_TOKEN))}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise TokenizerError(f"tokenizer lacks special tokens: {', '.join(missing)}")
    return ids
