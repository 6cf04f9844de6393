"""Tiny random models of several architectures, built once per test session."""

from __future__ import annotations

import pytest
import torch

from specdec.backends import hf
from specdec.backends.target import load_target
from specdec.commands.tiny import ARCHITECTURES, build_tokenizer, save_tiny

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """Target (2 layers) and a differently seeded draft (1 layer) per architecture, plus a GPT-2 draft."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for arch in ARCHITECTURES:
        dirs[arch] = save_tiny(root / arch, arch, tokenizer, init_std=0.15)
        dirs[f"{arch}-draft"] = save_tiny(root / f"{arch}-draft", arch, tokenizer, layers=1, seed=7, init_std=0.15)
    return dirs


@pytest.fixture(scope="session", params=["auto", "hf"])
def backend(request):
    """Tests that load targets run on both backends: "auto" is native where supported (GPT-2: transformers)."""
    return request.param


@pytest.fixture(scope="session")
def targets(model_dirs, backend):
    return {arch: load_target(model_dirs[arch], backend=backend) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    """transformers' own models of the same folders: the references every backend is checked against."""
    return {arch: hf.load_causal_lm(model_dirs[arch]) for arch in ARCHITECTURES}
