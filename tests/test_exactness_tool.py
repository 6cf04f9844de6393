"""The exactness tool on the committed zoo: its JSON says what ran and how many outputs differed."""

from __future__ import annotations

import json

from specdec.commands.exactness import first_difference, main


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # an output that stops early differs where it stops


def test_exactness_on_the_zoo_finds_no_difference(tmp_path, capsys):
    out = tmp_path / "exactness.json"
    code = main(["--prompts", "2", "--max-new-tokens", "8", "--dtype", "float32", "--backend", "native",
                 "--json", str(out), "--no-progress"])
    result = json.loads(out.read_text())
    assert code == 0 and result["identical"] and result["differing_runs"] == 0
    assert result["settings"]["backend_ran"] == "native/llama" and result["settings"]["prompts"] == 2
    configs = {(r["config"], r["batch"]) for r in result["runs"]}
    assert ("plain", "ragged") in configs and ("plain", "alone") not in configs  # plain alone is the reference
    for name in ("prompt-lookup k=4", "draft-model k=4", "prompt-lookup tree=4/2/8", "draft-model tree=4/2/8"):
        assert {(name, "alone"), (name, "ragged")} <= configs
    assert all(r["total"] == 2 and r["differing"] == 0 and r["diffs"] == [] and "refused" not in r
               for r in result["runs"])
    assert "all outputs identical" in capsys.readouterr().out


def test_a_difference_gives_exit_status_1(tmp_path, monkeypatch, capsys):
    import specdec.commands.exactness

    monkeypatch.setattr(specdec.commands.exactness, "first_difference", lambda reference, tokens: 0)
    code = main(["--prompts", "1", "--max-new-tokens", "2", "--backend", "native", "--no-progress"])
    assert code == 1 and "OUTPUTS DIFFER in 9 of 9 runs" in capsys.readouterr().out
