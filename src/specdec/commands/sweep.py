"""A registry-wide check: every causal-LM type transformers knows, built tiny, against specdec's promise.

specdec promises that ``generate(target, prompts, drafter=...)`` returns exactly transformers' greedy
output for any causal LM, or refuses with a one-line ``SpecdecError``. This module measures that
promise for every model type in transformers' causal-LM registry: it shrinks each type's default
config to a model of about a hundred thousand parameters (keeping its pattern of layer kinds, with
any attention window shorter than the generation), takes the path a user takes (``save_pretrained``,
then ``specdec.load_target``), and compares specdec's output with ``model.generate`` for three
drafters on three prompts of different lengths as one ragged batch, and for the drafting ones on
single prompts too.

Each type ends in one class:

* ``pass``: every output equals transformers' greedy output;
* ``refused``: specdec raised a ``SpecdecError`` (its message is recorded);
* ``mismatch``: some output differs (the drafter and batch are recorded);
* ``crash``: specdec raised anything else (type and first line recorded);
* ``unbuildable``: no tiny model could be built, or transformers itself cannot generate from it,
  or its greedy outputs are too uniform to prove anything.

Run ``python -m specdec.commands.sweep [--types a b c] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from specdec import drafters as drafter_classes
from specdec.backends import hf
from specdec.errors import SpecdecError
from specdec.backends.hf import quiet
from specdec.backends.target import load_target

CLASSES = ("pass", "refused", "mismatch", "crash", "unbuildable")

# The prompts: short Python, about 8, 23 and 36 tokens with specdec.commands.tiny's tokenizer.
PROMPTS = ("import os\n",
           "def add(a, b):\n    return a + b\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n")
MAX_NEW_TOKENS = 20       # past any window (8) by far; 28 in a thorough sweep
THOROUGH_MAX_NEW_TOKENS = 28
NUM_DRAFT_TOKENS = 4
MIN_DISTINCT = 6          # fewer distinct tokens in all greedy continuations: a degenerate model
# (initializer std, seed, untie embeddings) tried in turn until greedy outputs vary
INIT_SCHEDULE = ((0.3, 0, False), (0.3, 0, True), (0.6, 1, True), (1.0, 2, True))
DRAFT_NOISE = 0.015       # relative noise on the draft copy's weights: drafts partly rejected
TYPE_TIME_LIMIT = 20.0    # seconds for one type, building and checking: a stalled type is cut off

# Sizes of the tiny models.
HIDDEN, HEADS, HEAD_DIM, FFN, EXPERT_FFN = 64, 4, 16, 96, 32
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
MAX_POSITIONS, WINDOW, MAX_LAYERS = 256, 8, 4


class Unbuildable(Exception):
    """A model type that cannot be built tiny and run greedily by transformers itself."""


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that broad ``except Exception`` blocks let it pass."""


def causal_lm_types() -> list[str]:
    """Every model type of transformers' causal-LM registry, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``; a message that only introduces its cause gives the cause's."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if line.endswith(":") and exc.__cause__ is not None:
        return first_line(exc.__cause__)
    return f"{type(exc).__name__}: {line}".rstrip(": ")


# ----------------------------------------------------------------------------------------------
# Shrinking a config
# ----------------------------------------------------------------------------------------------

_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
                     "num_decoder_layers")
_OTHER_LAYER_COUNT_KEYS = ("encoder_layers", "num_encoder_layers")
_HIDDEN_KEYS = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "embedding_size",
                "word_embed_proj_dim", "lru_width", "emb_dim", "embedding_dim", "input_embedding_size",
                "output_embedding_size", "hidden_size_global", "backbone_hidden_size", "out_hidden_size"}
_HEAD_COUNT_KEYS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                    "encoder_attention_heads", "decoder_attention_heads", "num_encoder_attention_heads",
                    "num_decoder_attention_heads", "swa_num_attention_heads", "linear_num_heads",
                    "conf_num_attention_heads"}
_KV_HEAD_KEYS = {"num_key_value_heads": "num_attention_heads", "kv_n_heads": "n_heads",
                 "num_kv_heads": "num_attention_heads", "num_query_groups": "num_attention_heads",
                 "swa_num_key_value_heads": "swa_num_attention_heads"}
_HEAD_DIM_KEYS = {"head_dim", "d_head", "attention_head_size", "attention_head_dim", "dim_head", "kv_channels",
                  "swa_head_dim", "linear_head_dim", "linear_key_head_dim", "index_head_dim", "indexer_head_dim",
                  "v_head_dim", "d_kv"}
_FFN_KEYS = {"intermediate_size", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "ffn_dim", "ffn_hidden_size",
             "dim_ff", "dff", "feed_forward_size", "intermediate_size_mlp", "dense_intermediate_size",
             "prefix_dense_intermediate_size", "d_ff", "mlp_dim", "d_inner"}
_EXPERT_FFN_KEYS = {"moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
                    "shared_intermediate_size", "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size"}
_EXPERT_COUNT_KEYS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
_EXPERTS_PER_TOKEN_KEYS = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts",
                           "moe_top_k"}
_SHARED_EXPERT_KEYS = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"}
_GROUP_KEYS = {"n_group", "topk_group", "num_expert_group"}
_POSITION_KEYS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                  "seq_length", "max_target_positions", "context_length", "model_max_length"}
_WINDOW_KEYS = {"sliding_window", "attention_window_size", "window_size", "sliding_window_size",
                "local_attention_window_len", "attention_chunk_size", "local_attention"}
_INIT_KEYS = {"initializer_range", "init_std", "embed_init_std", "embedding_initializer_range"}
_SMALL_KEYS = {  # other widths and ranks: a fixed small value
    "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "qk_head_dim": 16, "index_n_heads": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1, "index_topk": 8,
    "index_block_size": 4, "index_topk_blocks": 2, "index_local_blocks": 1, "indexer_budget": 8,
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "time_step_rank": 8, "mamba_dt_rank": 8,
    "chunk_size": 16, "mamba_chunk_size": 16, "block_size": 16, "laurel_rank": 8,
    "hidden_size_per_layer_input": 8, "adapter_rank": 8, "gated_norm_rank": 8, "loop_gate_rank": 8,
    "hc_lowrank": 8, "ple_embed_dim": 8, "router_hidden_size": 16, "query_pre_attn_scalar": 16,
    "rotary_dim": 8, "zero_expert_num": 1, "o_groups": 2, "encoder_hash_byte_group_vocab": 64,
    "num_nextn_predict_layers": 0, "linear_value_head_dim": 2 * HEAD_DIM,
}
_FILL_NONE = {  # fields some defaults leave unset (a real checkpoint sets them)
    "head_dim": HEAD_DIM, "num_key_value_heads": 2, "num_experts_per_tok": EXPERTS_PER_TOKEN,
    "n_routed_experts": EXPERTS, "n_shared_experts": 1, "moe_intermediate_size": EXPERT_FFN,
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
    "indexer_compress_ratio": 2,
}
_RATIO_TO_HIDDEN = {"attention_hidden_size", "mamba_d_ssm"}
_INTERVAL_KEYS = {"sliding_window_pattern", "_sliding_window_pattern", "no_rope_layer_interval",
                  "interleave_moe_layer_step", "decoder_sparse_step", "moe_layer_interval", "layer_group_size",
                  "global_attn_every_n_layers"}
_COUNT_KEYS = {"first_k_dense_replace", "num_dense_layers", "max_window_layers", "moe_layer_start_index"}
_RANGE_KEYS = (("moe_layer_start_index", "moe_layer_end_index"), ("loop_layer_index_start", "loop_layer_index_end"))
_INDEX_LIST_SUFFIXES = ("layers", "layer_ids", "layer_idxs", "idxs", "layer_indices", "indices", "_ids")
_NOT_PER_LAYER = {"architectures", "time_step_limit", "mlp_multipliers", "ssm_multipliers", "suppress_tokens",
                  "begin_suppress_tokens", "axial_pos_shape", "axial_pos_embds_dim", "mrope_section"}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_count(config: dict) -> tuple[str | None, int]:
    for key in _LAYER_COUNT_KEYS:
        if _is_int(config.get(key)) and config[key] > 0:
            return key, config[key]
    return None, 0


def _choose_layers(config: dict, count: int) -> tuple[list[int], dict, dict]:
    """Which of the ``count`` layers to keep: the first of each distinct kind, at least 2, at most MAX_LAYERS.

    Kinds come from every per-layer list (``layer_types``, ``mlp_layer_types``...), every list of layer
    indices (``mlp_only_layers``...), per-layer override dicts and dense-prefix counts.
    """
    index_lists = {key: value for key, value in config.items()  # increasing layer numbers: [3, 7, 11]
                   if isinstance(value, list) and key not in _NOT_PER_LAYER and value
                   and key.endswith(_INDEX_LIST_SUFFIXES) and "token" not in key
                   and all(_is_int(i) and 0 <= i < count for i in value)
                   and all(a < b for a, b in zip(value, value[1:]))}
    per_layer = {key: value for key, value in config.items()  # one entry per layer: ["sliding", "full", ...]
                 if isinstance(value, list) and len(value) == count and count > 1 and key not in _NOT_PER_LAYER
                 and key not in index_lists}
    override_dicts = {key: value for key, value in config.items()
                      if isinstance(value, dict) and value and key.startswith("per_layer")
                      and all(str(k).isdigit() for k in value)}
    counts = {key: config[key] for key in _COUNT_KEYS if _is_int(config.get(key))}
    ranges = [(a, b) for a, b in _RANGE_KEYS if _is_int(config.get(a)) and _is_int(config.get(b))]
    shared = config.get("num_kv_shared_layers")

    def kind(i):
        return (tuple(json.dumps(value[i], sort_keys=True, default=str) for value in per_layer.values())
                + tuple(i in value for value in index_lists.values())
                + tuple(json.dumps(value.get(str(i).zfill(len(next(iter(value)))), None), sort_keys=True)
                        for value in override_dicts.values())
                + tuple(i < n for n in counts.values())
                + tuple(config[a] <= i <= config[b] for a, b in ranges)
                + ((i >= count - shared,) if _is_int(shared) and shared > 0 else ()))

    # A shorter list of layer kinds repeats over the stack (recurrent_gemma's block_types): keep one cycle.
    cycle = max([len(value) for key, value in config.items()
                 if isinstance(value, list) and 1 < len(value) < count and key.endswith(("types", "type"))
                 and all(isinstance(v, str) for v in value)] or [2])
    chosen, kinds = [], set()
    for i in range(count):
        if kind(i) not in kinds and len(chosen) < MAX_LAYERS:
            kinds.add(kind(i))
            chosen.append(i)
    for i in range(count):
        if len(chosen) >= min(cycle, count):
            break
        if i not in chosen:
            chosen.append(i)
    chosen.sort()
    return chosen, dict(per_layer=per_layer, index_lists=index_lists, override_dicts=override_dicts,
                        counts=counts, ranges=ranges), dict(shared=shared, count=count)


def _shrink_layers(config: dict) -> None:
    key, count = _layer_count(config)
    if key is None:
        return
    chosen, found, extra = _choose_layers(config, count)
    new = len(chosen)
    for name in _LAYER_COUNT_KEYS + _OTHER_LAYER_COUNT_KEYS:
        if _is_int(config.get(name)) and config[name] > 0:
            config[name] = new if name in _LAYER_COUNT_KEYS else min(config[name], 2)
    for name, value in found["per_layer"].items():
        config[name] = [value[i] for i in chosen]
    for name, value in found["index_lists"].items():
        config[name] = [chosen.index(i) for i in value if i in chosen]
    for name, value in found["override_dicts"].items():
        width = len(next(iter(value)))
        config[name] = {str(j).zfill(width): value[str(i).zfill(width)]
                        for j, i in enumerate(chosen) if str(i).zfill(width) in value}
    for name, n in found["counts"].items():
        config[name] = sum(i < n for i in chosen)
    for a, b in found["ranges"]:
        inside = [j for j, i in enumerate(chosen) if config[a] <= i <= config[b]]
        config[a], config[b] = (inside[0], inside[-1]) if inside else (new, new - 1)
    shared = extra["shared"]
    if _is_int(shared) and shared > 0:
        config["num_kv_shared_layers"] = sum(i >= count - shared for i in chosen)
    for name in _INTERVAL_KEYS:
        if _is_int(config.get(name)) and config[name] > 2:
            config[name] = 2
    for name in list(config):
        if name.endswith("_period") and _is_int(config[name]) and config[name] > 2:
            config[name] = 2
            offset = name[: -len("_period")] + "_offset"
            if _is_int(config.get(offset)):
                config[offset] = min(config[offset], 1)


def _shrink_value(key: str, value, config: dict, original: dict):
    """The tiny value of one field (value may be a per-layer list of such fields)."""
    if isinstance(value, list):
        return [_shrink_value(key, v, config, original) for v in value]
    if not _is_int(value) or value <= 0:
        return value
    if key in _HIDDEN_KEYS:
        return HIDDEN
    if key in _HEAD_COUNT_KEYS:
        return min(value, HEADS)
    if key in _KV_HEAD_KEYS:
        heads_key = _KV_HEAD_KEYS[key]
        heads = original.get(heads_key)
        if _is_int(heads) and value >= heads:
            return min(value, HEADS)
        return min(value, 2)
    if key == "linear_num_key_heads":
        return min(value, 2)
    if key == "linear_num_value_heads":
        keys = original.get("linear_num_key_heads")
        ratio = value // keys if _is_int(keys) and keys and value % keys == 0 else 1
        return min(value, 2) * ratio
    if key in _HEAD_DIM_KEYS:
        return HEAD_DIM
    if key in _FFN_KEYS:
        return FFN
    if key in _EXPERT_FFN_KEYS:
        return EXPERT_FFN
    if key in _EXPERT_COUNT_KEYS:
        return min(value, EXPERTS)
    if key in _EXPERTS_PER_TOKEN_KEYS:
        return min(value, EXPERTS_PER_TOKEN)
    if key in _SHARED_EXPERT_KEYS:
        return 1
    if key in _GROUP_KEYS:
        return 1
    if key in _POSITION_KEYS:
        return min(value, MAX_POSITIONS)
    if key in _WINDOW_KEYS:
        return min(value, WINDOW)
    if key in _SMALL_KEYS:
        return min(value, _SMALL_KEYS[key])
    if value in original.get("__widths__", ()) and value > HIDDEN and not re.search(r"token|index|_id$|ids$|seed", key):
        return HIDDEN  # another name for a model width (a projector's input or output, say)
    return value


def _shrink_override(key: str, value, fields: dict, original: dict):
    """A field of a per-layer override (``fields``); a head wider than the default one stays wider."""
    if key in _HEAD_DIM_KEYS and _is_int(value) and _is_int(original.get(key)) and value > original[key]:
        return 2 * HEAD_DIM
    return _shrink_value(key, value, {}, {**original, **fields})


def _widths(config: dict) -> set[int]:
    """Every model width (hidden size) anywhere in a config tree."""
    found = {config[k] for k in ("hidden_size", "d_model", "n_embd") if _is_int(config.get(k))}
    for value in config.values():
        if isinstance(value, dict):
            found |= _widths(value)
    return found


def _shrink(config: dict, vocab_size: int, eos_id: int, pad_id: int, init_std: float,
            widths: set[int] | None = None) -> dict:
    """A tiny copy of a config dict (and of its nested sub-config dicts)."""
    widths = _widths(config) if widths is None else widths
    original = {**config, "__widths__": widths}
    config = {key: value for key, value in config.items()
              if key not in ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype")}
    for key, value in _FILL_NONE.items():
        if key in config and config[key] is None:
            config[key] = value
    _shrink_layers(config)
    for key, value in list(config.items()):
        if isinstance(value, dict) and key not in ("id2label", "label2id") and not key.startswith("rope"):
            if "model_type" in value or any(k in value for k in _HIDDEN_KEYS | set(_LAYER_COUNT_KEYS)):
                config[key] = _shrink(value, vocab_size, eos_id, pad_id, init_std, widths)
            elif key.startswith("per_layer"):  # per-layer overrides: {"05": {"head_dim": 512}}
                config[key] = {layer: {k: _shrink_override(k, v, fields, original) for k, v in fields.items()}
                               if isinstance(fields, dict) else fields for layer, fields in value.items()}
            continue
        if key in _RATIO_TO_HIDDEN and _is_int(value) and _is_int(original.get("hidden_size")):
            config[key] = max(1, round(value * HIDDEN / original["hidden_size"]))
            continue
        config[key] = _shrink_value(key, value, config, original)
    # Multi-head latent attention: the rotary part is the head_dim the rotary embedding uses.
    if (_is_int(config.get("qk_rope_head_dim")) and _is_int(config.get("head_dim"))
            and original.get("head_dim") == original.get("qk_rope_head_dim")):
        config["head_dim"] = config["qk_rope_head_dim"]
    if _is_int(config.get("qk_head_dim")) and _is_int(config.get("qk_nope_head_dim")):
        config["qk_head_dim"] = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    if config.get("is_decoder") is False and not config.get("is_encoder_decoder"):
        config["is_decoder"] = True  # encoder families (BERT...) are causal LMs only as decoders
    if config.get("rope_parameters") == {} and isinstance(config.get("layer_types"), list):
        config["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                     for kind in dict.fromkeys(config["layer_types"])}
    for key in ("vocab_size", "unpadded_vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input"):
        if _is_int(config.get(key)) and config[key] > 0:
            config[key] = vocab_size
    for key in ("eos_token_id", "bos_token_id", "decoder_start_token_id"):
        if key in config:
            config[key] = eos_id
    if "pad_token_id" in config:
        config["pad_token_id"] = pad_id
    for key in ("forced_eos_token_id", "forced_bos_token_id"):
        if key in config:
            config[key] = None
    for key in ("sep_token_id", "cls_token_id", "mask_token_id"):
        if _is_int(config.get(key)) and config[key] >= vocab_size:
            config[key] = pad_id
    for key in _INIT_KEYS:
        if isinstance(config.get(key), float):
            config[key] = init_std
    if isinstance(config.get("initializer_factor"), float):
        config["initializer_factor"] = init_std / 0.02
    for key in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "resid_pdrop",
                "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if isinstance(config.get(key), float):
            config[key] = 0.0
    if config.get("use_mamba_kernels"):
        config["use_mamba_kernels"] = False
    _fix_mamba(config)
    return config


def _fix_mamba(config: dict) -> None:
    """SSM heads times head width must equal the expanded width."""
    expand = config.get("mamba_expand", config.get("expand"))
    if not _is_int(expand):
        return
    inner = expand * HIDDEN
    for heads_key, dim_key in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
                               ("num_heads", "head_dim"), ("n_mamba_heads", "mamba_headdim")):
        if _is_int(config.get(heads_key)) and _is_int(config.get(dim_key)):
            config[dim_key] = HEAD_DIM
            config[heads_key] = inner // HEAD_DIM
    if _is_int(config.get("mamba_d_ssm")):
        config["mamba_d_ssm"] = inner
    for key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
        if _is_int(config.get(key)):
            config[key] = 1


# Types whose defaults the generic rules cannot make consistent: what a real small checkpoint would set.
_DEFAULT_KWARGS = {  # needed for the default config to build at all
    "gemma4_assistant": dict(text_config=dict(model_type="gemma4_text", hidden_size_per_layer_input=0,
                                              vocab_size_per_layer_input=0)),
}
_OVERRIDES = {  # applied to the shrunk config
    "bamba": dict(attn_layer_indices=[1]),  # the default has no attention layer at all
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),  # defaults: attention only
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "xmod": dict(default_language="en_XX"),
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,  # >= 2 shared-attention layers
                  layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
    "hrm_text": dict(num_layers_per_stack=None, num_hidden_layers=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1]),
    "dory": dict(num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,
                 layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),  # read by the modeling code, unset by default
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 16], hash_seed=0,
                     local_attn_chunk_length=16, lsh_attn_chunk_length=16),
    "inkling2_loop_text": dict(num_hidden_layers=3, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                               n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2,
                               loop_num_passes=2),
}


def config_class(model_type: str):
    from transformers import CONFIG_MAPPING
    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        raise Unbuildable(f"no config class for {model_type}") from None


def _merge(config: dict, updates: dict) -> None:
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = value


def tiny_config(model_type: str, vocab_size: int, eos_id: int, pad_id: int, init_std: float = INIT_SCHEDULE[0][0],
                untie: bool = False):
    """The type's default config shrunk to a model that builds and runs in milliseconds.

    ``untie`` unties the output head from the input embedding: with tied weights and a residual stream
    dominated by the token's own embedding, a random model tends to repeat its input token forever.
    """
    cls = config_class(model_type)
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            defaults = cls(**_DEFAULT_KWARGS.get(model_type, {})).to_dict()
        except Exception as exc:
            raise Unbuildable(f"default config does not build: {first_line(exc)}") from None
        tiny = _shrink(defaults, vocab_size, eos_id, pad_id, init_std)
        _merge(tiny, copy.deepcopy(_OVERRIDES.get(model_type, {})))
        for part in (tiny, tiny.get("text_config")) if untie else ():
            if isinstance(part, dict) and part.get("tie_word_embeddings"):
                part["tie_word_embeddings"] = False
        try:
            return cls.from_dict(tiny)
        except Exception as exc:
            raise Unbuildable(f"tiny config rejected: {first_line(exc)}") from None


# ----------------------------------------------------------------------------------------------
# Building and checking one type
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise _Timeout in the main thread after ``seconds`` (no limit off the main thread or when None)."""
    import threading
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _tied(config) -> bool:
    return any(getattr(c, "tie_word_embeddings", False) for c in (config, config.get_text_config(decoder=True)))


@contextlib.contextmanager
def _silenced():
    """Swallow what model code prints (some print warnings) and Python warnings."""
    import io
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def build_model(config, seed: int):
    """A random model of the config, as a user builds one: AutoModelForCausalLM.from_config.

    A composite config whose causal LM class wants only the decoder part (MusicGen) gets that part.
    """
    from transformers import AutoModelForCausalLM
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        except Exception as exc:
            text = config.get_text_config(decoder=True)
            if text is config:
                raise Unbuildable(f"from_config failed: {first_line(exc)}") from None
            try:
                import transformers
                from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                torch.manual_seed(seed)
                model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])(text)
            except Exception:
                raise Unbuildable(f"from_config failed: {first_line(exc)}") from None
    return model.float().eval()


def greedy_without_eos(model, pad_id: int) -> None:
    """The model's own generation config, greedy and with no stop token (generation runs to the limit)."""
    from transformers import GenerationConfig
    config = copy.deepcopy(getattr(model, "generation_config", None) or GenerationConfig())
    config.do_sample, config.eos_token_id, config.pad_token_id = False, None, pad_id
    model.generation_config = config


def reference(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    """transformers' greedy generate on each prompt alone (unpadded), without EOS stopping."""
    greedy_without_eos(model, pad_id)
    outputs = []
    with quiet(), warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=pad_id)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def distinct_tokens(outputs: list[list[int]]) -> int:
    return len({token for row in outputs for token in row})


def check_variety(outputs: list[list[int]], minimum: int = MIN_DISTINCT) -> int:
    """The number of distinct tokens in greedy continuations; Unbuildable when too few to prove anything."""
    distinct = distinct_tokens(outputs)
    if distinct < minimum:
        raise Unbuildable(f"degenerate outputs ({distinct} distinct tokens < {minimum})")
    return distinct


def noisy_copy(model, scale: float | None = None, seed: int = 1234):
    """The model with relative Gaussian noise on its floating weights: a draft that is often, not always, right."""
    scale = DRAFT_NOISE if scale is None else scale
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            if param.is_floating_point() and param.numel() > 1:
                spread = float(param.float().std()) or 1.0
                param.add_(torch.randn(param.shape, generator=generator) * (scale * spread))
    return draft.eval()


def _try_reference(model, prompts, pad_id: int, max_new_tokens: int) -> list[list[int]]:
    try:
        return reference(model, prompts, max_new_tokens, pad_id)
    except (_Timeout, Unbuildable):
        raise
    except Exception as exc:
        raise Unbuildable(f"transformers' generate failed: {first_line(exc)}") from None


def check_type(model_type: str, tokenizer=None, prompts: list[list[int]] | None = None,
               time_limit_s: float | None = TYPE_TIME_LIMIT, thorough: bool = False) -> dict:
    """Build a tiny ``model_type`` and compare specdec with transformers; returns one result record.

    ``thorough`` runs every drafter on each prompt alone as well, and generates more tokens (slower).
    """
    import specdec

    from specdec.commands.tiny import build_tokenizer

    tokenizer = tokenizer or build_tokenizer()
    if prompts is None:
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    started = time.perf_counter()
    result = dict(model_type=model_type, status=None, reason="", message="", details=[], distinct=None, init_std=None,
                  untied=None, attempts=[], acceptance=None, seconds=None)
    stage = "building"
    try:
        with time_limit(time_limit_s), tempfile.TemporaryDirectory(prefix="sweep-") as tmp, _silenced():
            vocab, eos, pad = len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id
            directory = Path(tmp) / "model"
            tried, tied = set(), _tied(tiny_config(model_type, vocab, eos, pad))
            for init_std, seed, untie in INIT_SCHEDULE:
                stage, target, refusal, load_crash = "building", None, None, None
                untie = untie and tied
                config = tiny_config(model_type, vocab, eos, pad, init_std, untie)
                if (init_std, seed, untie) in tried:
                    continue  # an untied model is the same with or without untying
                tried.add((init_std, seed, untie))
                model = build_model(config, seed)
                with quiet():
                    model.save_pretrained(directory)
                tokenizer.save_pretrained(directory)
                stage = "loading"
                try:
                    target = load_target(directory)
                except SpecdecError as exc:  # refused at load: is transformers itself able to run it?
                    refusal = exc
                except Exception as exc:  # specdec's loader broke: a crash, unless transformers cannot run it
                    load_crash = f"{first_line(exc)} {where(exc)} (load_target)"
                stage = "reference"
                # transformers' own model: the loaded one, or the one built (when specdec runs its own)
                reference_model = model if target is None or getattr(target, "model", None) is None else target.model
                if refusal is not None:  # as a user would run it in transformers: loaded from the folder
                    try:
                        reference_model = hf.load_causal_lm(directory)
                    except Exception:
                        pass
                max_new_tokens = THOROUGH_MAX_NEW_TOKENS if thorough else MAX_NEW_TOKENS
                expected = _try_reference(reference_model, prompts, pad, max_new_tokens)
                result["attempts"].append(dict(init_std=init_std, seed=seed, untied=untie,
                                               distinct=distinct_tokens(expected)))
                result["distinct"] = distinct_tokens(expected)
                if result["distinct"] >= MIN_DISTINCT:
                    result["init_std"], result["untied"] = init_std, untie
                    break
            else:
                check_variety(expected)  # raises Unbuildable("degenerate outputs ...")
            if refusal is not None:
                return _finish(result, "refused", _refusal_reason(refusal), started)
            if load_crash is not None:
                return _finish(result, "crash", load_crash, started)
            stage = "specdec"
            target.eos_token_ids = ()
            if hasattr(target, "generation_config"):  # specdec applies the generation config's rules too
                target.generation_config = reference_model.generation_config
            outcomes = _run_cases(specdec, drafter_classes, target, reference_model, prompts, expected, result,
                                  max_new_tokens, thorough)
    except _Timeout:
        status = "crash" if stage == "specdec" else "unbuildable"
        return _finish(result, status, f"timed out while {stage} (limit {time_limit_s:.0f} s)", started)
    except Unbuildable as exc:
        return _finish(result, "unbuildable", str(exc), started)
    except SpecdecError as exc:
        return _finish(result, "refused", _refusal_reason(exc), started)
    except Exception as exc:
        if stage == "specdec":
            return _finish(result, "crash", f"{first_line(exc)} {where(exc)}", started)
        return _finish(result, "unbuildable", f"{stage}: {first_line(exc)}", started)
    for status in ("crash", "mismatch", "refused"):
        bad = [o for o in outcomes if o["status"] == status]
        if bad:
            result["details"] = [f"{o['status']}: " + (o["reason"] if o["status"] == "mismatch"
                                                        else f"{o['case']}: {o['reason']}")
                                 for o in outcomes if o["status"] != "pass"]
            return _finish(result, status, bad[0]["reason"], started)
    return _finish(result, "pass", "", started)


def where(exc: BaseException) -> str:
    """Where an exception was raised, and the last specdec frame on its way: ``[at file:line in f; ...]``."""
    import traceback
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""

    def short(frame):
        path = Path(frame.filename).as_posix()
        for anchor in ("site-packages/", "src/"):
            if anchor in path:
                path = path.rsplit(anchor, 1)[1]
                break
        return f"{path}:{frame.lineno} in {frame.name}"

    text = f"at {short(frames[-1])}"
    ours = [f for f in frames if "/specdec/" in Path(f.filename).as_posix() and not f.filename.endswith("sweep.py")]
    if ours and ours[-1] is not frames[-1]:
        text += f"; from {short(ours[-1])}"
    return f"[{text}]"


def _refusal_reason(exc: BaseException) -> str:
    text = str(exc)
    return text if text and "\n" not in text.strip() else f"(multi-line message) {text!r}"


def _finish(result: dict, status: str, reason: str, started: float) -> dict:
    result["status"], result["message"] = status, reason
    result["reason"] = re.sub(r"\S*sweep-[\w-]+/model", "<model dir>", reason)
    result["details"] = [re.sub(r"\S*sweep-[\w-]+/model", "<model dir>", d) for d in result["details"]]
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def _run_cases(specdec, drafters, target, model, prompts, expected, result, max_new_tokens: int,
               thorough: bool = False) -> list[dict]:
    """Every drafter on all prompts as one ragged batch; the draft model also on single prompts.

    The draft model's drafts are partly rejected at almost every step, so it exercises rollback
    alone (shortest and longest prompt) and with padding; plain decoding and prompt lookup (whose
    proposals vary in length from row to row) run in the ragged batch. These five runs keep the
    whole sweep within its time budget; ``thorough`` runs every drafter on every prompt alone too.
    """
    draft = noisy_copy(model)
    outcomes, proposed, accepted = [], 0, 0
    every = [([i], f"prompt {i} alone") for i in range(len(prompts))]
    alone = every if thorough else [every[0], every[-1]]
    ragged = [(list(range(len(prompts))), f"ragged batch of {len(prompts)}")]
    others = every + ragged if thorough else ragged
    for drafter, batches in ((drafters.NoDraft(), others), (drafters.PromptLookup(max_ngram=3), others),
                             (drafters.DraftModel(draft), alone + ragged)):
        for rows, label in batches:
            case = f"{drafter.name}, {label}"
            try:
                out = specdec.generate(target, [prompts[i] for i in rows], drafter=drafter,
                                       num_draft_tokens=NUM_DRAFT_TOKENS, max_new_tokens=max_new_tokens)
            except _Timeout:
                raise
            except SpecdecError as exc:
                outcomes.append(dict(case=case, status="refused", reason=_refusal_reason(exc)))
                continue
            except Exception as exc:
                outcomes.append(dict(case=case, status="crash", reason=f"{first_line(exc)} {where(exc)}"))
                continue
            wrong = [i for i, row in zip(rows, out.token_ids) if row != expected[i]]
            if wrong:
                first = wrong[0]
                got, want = out.token_ids[rows.index(first)], expected[first]
                at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                outcomes.append(dict(case=case, status="mismatch",
                                     reason=f"{case}: prompt {first} differs from token {at}"))
            else:
                outcomes.append(dict(case=case, status="pass", reason=""))
            if drafter.name == "draft-model":
                proposed += out.stats.drafts_evaluated
                accepted += out.stats.drafts_accepted
    if proposed:
        result["acceptance"] = round(accepted / proposed, 3)
    return outcomes


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------

def sweep(types: list[str] | None = None, progress=print, time_limit_s: float | None = TYPE_TIME_LIMIT,
          thorough: bool = False) -> list[dict]:
    """Check every type (default: the whole causal-LM registry) on one torch thread; one record per type."""
    from specdec.commands.tiny import build_tokenizer
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    types = types or causal_lm_types()
    results = []
    for index, model_type in enumerate(types, 1):
        record = check_type(model_type, tokenizer, prompts, time_limit_s, thorough)
        results.append(record)
        if progress:
            progress(f"[{index:3d}/{len(types)}] {model_type:<28} {record['status']:<11} {record['seconds']:6.2f}s"
                     f"  {record['reason']}"[:200])
    return results


def _group_key(record: dict) -> str:
    """A record's reason with what is particular to one type (class names, positions) left out."""
    reason = record["reason"]
    if record["status"] == "mismatch":
        return reason.split(":")[0]
    model_class = r"\b\w+(ForCausalLM|LMHeadModel|ForConditionalGeneration|WithLMHeadModel|ModelWithLMHead|Decoder)\b"
    reason = re.sub(model_class, "<Model>", reason)
    reason = re.sub(r"<class '[\w.]+'>", "<class>", reason)
    reason = re.sub(r"models/\w+/modeling_\w+\.py:\d+", "models/<type>/modeling_<type>.py", reason)
    return reason


def summary(results: list[dict], seconds: float | None = None, width: int = 160) -> str:
    """Counts per class, then every non-passing type grouped by reason."""
    counts = {name: sum(r["status"] == name for r in results) for name in CLASSES}
    lines = [f"{len(results)} types" + (f" in {seconds:.1f} s" if seconds is not None else "") + ": "
             + ", ".join(f"{counts[name]} {name}" for name in CLASSES)]
    for name in ("mismatch", "crash", "refused", "unbuildable"):
        bad = [r for r in results if r["status"] == name]
        if not bad:
            continue
        lines.append(f"\n{name} ({len(bad)}):")
        groups: dict[str, list[dict]] = {}
        for record in bad:
            groups.setdefault(_group_key(record), []).append(record)
        for key, records in sorted(groups.items(), key=lambda item: -len(item[1])):
            if len(records) == 1:
                lines.append(f"  {records[0]['model_type']}: {records[0]['reason'][:width]}")
            else:
                lines.append(f"  [{len(records)}] {key[:width]}")
                lines.append("      " + ", ".join(r["model_type"] for r in records))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.commands.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", help="model types to check (default: every causal-LM type)")
    parser.add_argument("--json", type=Path, help="write the per-type results to this file")
    parser.add_argument("--time-limit", type=float, default=TYPE_TIME_LIMIT, help="seconds per type")
    parser.add_argument("--thorough", action="store_true",
                        help=f"every drafter on each prompt alone too, {THOROUGH_MAX_NEW_TOKENS} new tokens (slower)")
    args = parser.parse_args(argv)
    known = set(causal_lm_types())
    unknown = [t for t in args.types or () if t not in known]
    if unknown:
        parser.error(f"not causal-LM types: {', '.join(unknown)}")
    started = time.perf_counter()
    results = sweep(args.types, time_limit_s=args.time_limit, thorough=args.thorough)
    seconds = time.perf_counter() - started
    print()
    print(summary(results, seconds))
    if args.json:
        import transformers
        settings = dict(thorough=args.thorough, max_new_tokens=THOROUGH_MAX_NEW_TOKENS if args.thorough
                        else MAX_NEW_TOKENS, num_draft_tokens=NUM_DRAFT_TOKENS, transformers=transformers.__version__,
                        torch=torch.__version__)
        args.json.write_text(json.dumps(dict(seconds=round(seconds, 1), settings=settings, results=results),
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
