"""`specdec bench-serve`, small: two modes, one and two clients, two tokens, JSON and plot written;
servers in processes of their own, and in this one."""

from __future__ import annotations

import json

import pytest

from specdec.commands.cli import main


@pytest.mark.parametrize("where", [[], ["--in-process"]], ids=["own-process", "in-process"])
def test_bench_serve_smoke(where, tmp_path, capsys):
    output, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    code = main(["bench-serve", "--drafter", "prompt-lookup", "--modes", "plain", "fixed", "--concurrency", "1", "2",
                 "--requests-per-client", "1", "--max-tokens", "2", "--output", str(output), "--plot", str(plot),
                 *where])
    assert code == 0
    result = json.loads(output.read_text())
    assert result["server"] == ("in-process" if where else "own process")
    assert list(result["modes"]) == ["plain", "fixed"]
    for mode in result["modes"].values():
        assert mode["startup_seconds"] > 0
        assert [w["concurrency"] for w in mode["waves"]] == [1, 2]
        assert all(w["errors"] == 0 and w["completion_tokens"] > 0 and w["throughput"] > 0 for w in mode["waves"])
    assert result["modes"]["plain"]["waves"][0]["mean_acceptance_length"] is None
    assert plot.stat().st_size > 0
    assert "throughput" not in capsys.readouterr().err
