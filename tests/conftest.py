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


@pytest.fixture
def timed_backend(monkeypatch):
    """A backend whose passes take no real time: ``make(cost)`` returns (backend, clock), each forward pass
    advancing ``backends.costs``' clock by ``cost(width, hidden_layers, call)`` seconds (call: the pass's
    number, from 1; ``clock["calls"]`` may be set to start elsewhere)."""
    from specdec.backends import costs

    clock = {"now": 0.0, "calls": 0}
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock["now"])

    def make(cost):
        class Cache:
            lengths = torch.zeros(1, dtype=torch.long)

            def forward(self, tokens, valid, logits_to_keep=1, hidden_layers=()):
                clock["calls"] += 1
                clock["now"] += cost(tokens.shape[1], hidden_layers, clock["calls"])

            def truncate(self, lengths):
                pass

        class Backend:
            vocab_size, device, name = 50, "cpu", "fake"

            def new_cache(self, rows, capacity):
                return Cache()

        return Backend(), clock

    return make
