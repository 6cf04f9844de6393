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


def test_bench_serve_rounds_alternate_the_modes_and_pair_their_ratios(tmp_path, capsys):
    """--rounds 3: three waves of each mode per concurrency, the order reversed in the middle round, and each
    mode's median and its ratio to the first mode within each round."""
    from specdec.serve import bench

    order = []
    real = bench.run_wave

    def recording(url, *args):
        order.append(url)
        return real(url, *args)

    bench.run_wave = recording
    try:
        output = tmp_path / "rounds.json"
        code = main(["bench-serve", "--in-process", "--drafter", "prompt-lookup", "--modes", "plain", "fixed",
                     "--concurrency", "1", "--rounds", "3", "--requests-per-client", "1", "--max-tokens", "2",
                     "--output", str(output)])
    finally:
        bench.run_wave = real
    assert code == 0
    assert order[0] == order[3] == order[4] and order[1] == order[2] == order[5] and order[0] != order[1]
    result = json.loads(output.read_text())
    assert result["rounds"] == 3
    for mode in ("plain", "fixed"):
        assert [w["round"] for w in result["modes"][mode]["waves"]] == [0, 1, 2]
    (entry,) = result["rounds_summary"]
    assert entry["reference"] == "plain" and entry["modes"]["plain"]["ratios"] == [1.0, 1.0, 1.0]
    fixed = entry["modes"]["fixed"]
    waves = result["modes"]["fixed"]["waves"]
    assert fixed["throughput"] == sorted(w["throughput"] for w in waves)[1]
    expected = [w["throughput"] / p["throughput"] for w, p in zip(waves, result["modes"]["plain"]["waves"])]
    assert fixed["ratios"] == [round(ratio, 4) for ratio in expected]
    assert "median of 3 rounds" in capsys.readouterr().out


def test_bench_serve_refuses_no_rounds_in_one_line(capsys):
    assert main(["bench-serve", "--rounds", "0", "--concurrency", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--rounds must be >= 1" in err and len(err.splitlines()) == 1
