"""``specdec zoo build --preset tiny`` runs every stage end to end into a temp folder."""

import json

import torch
from transformers import AutoModelForCausalLM

from specdec.commands.train import main
from specdec.zoo import corpus, tasks


def test_tiny_build_produces_a_complete_zoo(tmp_path, capsys, monkeypatch):
    torch.set_num_threads(1)
    full_read = corpus.read_split
    monkeypatch.setattr(corpus, "read_split", lambda split, root=None: full_read(split, root)[:12])  # keep it quick
    out, work = tmp_path / "zoo", tmp_path / "work"
    assert main(["zoo", "build", "--preset", "tiny", "--out", str(out), "--work-dir", str(work)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["draft_parameters"] < summary["target_parameters"]
    for name in ("target", "draft"):
        AutoModelForCausalLM.from_pretrained(out / name)
        assert not (out / name / "checkpoints").exists()
    from specdec.drafters import DFlash, Eagle, Medusa

    assert Eagle(out / "eagle", version=1) and Eagle(out / "eagle3", version=3) and Medusa(out / "medusa")
    assert DFlash(out / "dflash").block_size == 4
    assert set(summary["drafters_offline"]) == {"medusa", "eagle", "eagle3", "dflash"}
    import specdec
    from specdec.drafters import MTP, EarlyExit

    assert set(summary["variants_validation"]) == {"layerskip", "mtp", "mtp-parallel"}
    for name, drafter in (("layerskip", EarlyExit()), ("mtp", MTP()), ("mtp-parallel", MTP())):
        AutoModelForCausalLM.from_pretrained(out / name)  # an ordinary causal LM
        variant = specdec.load_target(out / name)
        plain = specdec.generate(variant, "def f(x):", max_new_tokens=8).token_ids
        assert specdec.generate(variant, "def f(x):", drafter=drafter, max_new_tokens=8).token_ids == plain
    for name in tasks.TASK_NAMES:
        assert len(tasks.load_tasks(name, out / "tasks")) >= 50
