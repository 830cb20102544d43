"""Nothing in the repository is written by default, and no existing file is replaced unless
overwrite=true: commands write into the run directory (here the test's cwd, as no Hydra run is
active), and refuse existing files before any expensive work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsim.commands.plot import run as plot
from kvsim.core.outputs import OutputExistsError, check_new
from kvsim.core.paths import DATA_DIR, ROOT
from kvsim.model.presets import load_model_preset
from kvsim.plots.options import PlotOptions
from kvsim.quality import run as quality_run
from kvsim.quality.run import AcceptanceRunConfig, QualityConfig, run_quality
from kvsim.scenario.acceptance import ACCEPTANCE_DIR

SURVIVAL = dict(kind="survival", input=str(ACCEPTANCE_DIR / "smollm2-135m-lynx-s1-greedy.json"),
                formats=["png"])


def _repo_state() -> list[str]:
    """Every changed, untracked or ignored path of the checkout (bytecode aside)."""
    out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return sorted(line for line in out.splitlines() if "__pycache__" not in line)


def _tiny_quality(**kw) -> QualityConfig:
    base = dict(model=load_model_preset("tiny-random"), codecs=["bf16"], context_tokens=24,
                heldout_tokens=4, runs=1, progress=False,
                speculative=AcceptanceRunConfig(max_draft=3, prefixes="all"))
    return QualityConfig(**{**base, **kw})


def test_check_new_names_the_file_and_the_flag(tmp_path):
    existing, new = tmp_path / "a.json", tmp_path / "b.json"
    existing.write_text("{}")
    check_new([new], overwrite=False)
    check_new([existing, new], overwrite=True)
    with pytest.raises(OutputExistsError, match=rf"{existing}.*overwrite=true"):
        check_new([new, existing], overwrite=False)


def test_default_cli_runs_write_nothing_into_the_repository(tmp_path):
    before = _repo_state()
    # runs go under the cwd (no KVSIM_OUTPUT_ROOT): outputs/<date>/<time>-<command>/
    env = {**{k: v for k, v in os.environ.items() if k != "KVSIM_OUTPUT_ROOT"},
           "PYTHONDONTWRITEBYTECODE": "1"}
    for args in (["quality", "model=tiny-random", "codecs=[bf16]", "context_tokens=24",
                  "heldout_tokens=4", "runs=1", "speculative.max_draft=3",
                  "speculative.prefixes=all", "progress=false"],
                 ["plot", "kind=survival", f"input={SURVIVAL['input']}", "formats=[png]"]):
        proc = subprocess.run([sys.executable, "-m", "kvsim", *args], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
    assert _repo_state() == before
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert all(w.startswith("outputs/") for w in written), written
    for name in ("captures/tiny-random-ctx24.pt", "synthetic/tiny-random.json",
                 "vnmse/tiny-random-ctx24.json", "acceptance/tiny-random-bf16-s1-greedy.json",
                 "survival.png"):
        assert any(w.endswith(name) for w in written), (name, written)


def test_quality_keeps_existing_files_and_checks_before_loading(tmp_path, monkeypatch):
    rows, summary = run_quality(_tiny_quality(out_dir=str(tmp_path)))
    vnmse = Path(summary["files"]["vnmse"])
    kept = vnmse.read_bytes()

    def no_load(cfg):
        raise AssertionError("the model was loaded before the outputs were checked")

    with monkeypatch.context() as m:
        m.setattr(quality_run, "_load", no_load)
        with pytest.raises(OutputExistsError, match="overwrite=true"):
            run_quality(_tiny_quality(out_dir=str(tmp_path)))
    assert vnmse.read_bytes() == kept
    rows, again = run_quality(_tiny_quality(out_dir=str(tmp_path), overwrite=True))
    assert set(again["files"]) == set(summary["files"])


def test_quality_refuses_random_weights_in_data():
    with pytest.raises(ValueError, match="random weights"):
        run_quality(_tiny_quality(out_dir=str(DATA_DIR)))


def test_plot_default_goes_to_the_run_directory_and_keeps_existing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    [row] = plot(PlotOptions(**SURVIVAL))
    assert row["files"] == [str(tmp_path / "survival.png")]
    png = tmp_path / "survival.png"
    kept = png.read_bytes()
    with pytest.raises(OutputExistsError, match=rf"{png}.*overwrite=true"):
        plot(PlotOptions(**SURVIVAL))
    assert png.read_bytes() == kept
    plot(PlotOptions(**SURVIVAL, overwrite=True, title="replaced"))
    assert png.read_bytes() != kept
