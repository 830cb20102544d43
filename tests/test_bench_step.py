"""kvsim bench step (kvsim.fidelity.step_stability): the spread by hand, the runs it times on
the tiny random model, the command's report and its refusals. The spread itself is this
host's, reported by the bench."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import kvsim.fidelity.step_stability as ss
from kvsim.cli.main import main
from kvsim.fidelity.decode_steps import prompt_kv
from kvsim.model.load import load_lm
from kvsim.model.presets import load_model_preset


def _run(i: int, mean_s: float, context: int = 64) -> ss.StepRun:
    return ss.StepRun(context, i, mean_s, mean_s, 0.0, 0.0)


def test_the_spread_by_hand():
    """Runs of 0.10, 0.11, 0.099, 0.10 s per step: back-to-back changes 10%, 10% and 1.0101%
    (mean 7.0034%), slowest / fastest 0.11 / 0.099, the median run 0.10, cv the population
    standard deviation over the mean; back-to-back pairs' means 0.105, 0.1045, 0.0995: 5%,
    4.5% and 0.5% from the median run."""
    got = ss.stability([_run(i, m) for i, m in enumerate((0.10, 0.11, 0.099, 0.10))])
    assert got.context_tokens == 64 and got.runs == 4
    assert got.median_step_s == pytest.approx(0.10)
    assert got.consecutive_max == pytest.approx(0.10)
    assert got.consecutive_mean == pytest.approx((0.10 + 0.10 + 1 / 99) / 3)
    assert got.slowest_over_fastest == pytest.approx(0.11 / 0.099)
    assert got.two_runs_off_max == pytest.approx(0.05)
    assert got.two_runs_off_mean == pytest.approx((0.05 + 0.045 + 0.005) / 3)
    mean = (0.10 + 0.11 + 0.099 + 0.10) / 4
    sd = (sum((m - mean) ** 2 for m in (0.10, 0.11, 0.099, 0.10)) / 4) ** 0.5
    assert got.cv == pytest.approx(sd / mean)
    with pytest.raises(ValueError, match=">= 2 runs at one context"):
        ss.stability([_run(0, 0.1)])
    with pytest.raises(ValueError, match=">= 2 runs at one context"):
        ss.stability([_run(0, 0.1), _run(1, 0.1, context=128)])


def test_each_run_times_its_steps_on_a_fresh_cache():
    """Three runs of two steps on the tiny model: one row each, in order, at the cache's
    context, every step positive; no timing thread left behind; a run over its timeout
    stops the measurement with the figure."""
    lm = load_lm(load_model_preset("tiny-random"), threads=1, seed=0)
    kv, token = prompt_kv(lm, 40, "stdlib-docs", 1009)  # as the command builds it
    assert kv.dtype == torch.bfloat16 and kv.shape[3] == 40
    said: list[str] = []
    runs = ss.measure(lm, kv, token, runs=3, steps=2, threads=1, timeout_s=60,
                      say=said.append)
    assert [(r.context_tokens, r.run) for r in runs] == [(40, 0), (40, 1), (40, 2)]
    assert all(r.mean_step_s > 0 and r.median_step_s > 0 for r in runs)
    assert all(r.background_cores is None or r.background_cores >= 0 for r in runs)
    assert len(said) == 3 and "run 3/3" in said[-1]
    assert not [t for t in threading.enumerate() if t.name == "kvsim-timed-steps"]
    with pytest.raises(TimeoutError, match="more than 1e-06 s"):
        ss.measure(lm, kv, 0, runs=2, steps=2, threads=1, timeout_s=1e-6)
    with pytest.raises(ValueError, match="runs >= 2"):
        ss.measure(lm, kv, 0, runs=1, steps=2, threads=1, timeout_s=60)


def test_command_reports_every_run_and_the_spread(tmp_path, capsys):
    args = ["bench", "step", "model=tiny-random", "contexts=[32,48]", "runs=2", "steps=2",
            "progress=false", f"hydra.run.dir={tmp_path}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "x median run" in out and "back-to-back runs differ by" in out
    assert "the average of two back-to-back runs is off the median run by" in out
    assert out.index("context 32: 2 runs") < out.index("ctx", out.index("context 32: 2 runs"))
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(r["context_tokens"], r["run"]) for r in report["rows"]] == [
        (32, 0), (32, 1), (48, 0), (48, 1)]
    # two runs: the median is their mean, so their ratios straddle 1
    ratios = [r["ratio"] for r in report["rows"][:2]]
    assert sum(ratios) == pytest.approx(2.0)
    assert [s["context_tokens"] for s in report["stability"]] == [32, 48]
    for bad, says in ((["runs=1"], "runs >= 2"), (["contexts=[8]"], ">= 16 tokens"),
                      (["timeout_s=0"], "timeout_s")):
        assert main(["bench", "step", "model=tiny-random", *bad,
                     f"hydra.run.dir={tmp_path}"]) != 0
        assert says in capsys.readouterr().err
