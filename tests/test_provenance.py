"""Provenance: git state with a dirty marker, and every data file a run loaded, hashed."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from kvsim.cli.main import main
from kvsim.core import data_files
from kvsim.core.paths import DATA_DIR, ROOT
from kvsim.core.report import git_state, provenance


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sim_report_lists_acceptance_and_codec_timing_files(tmp_path):
    data_files.forget_loaded()
    report = tmp_path / "r.json"
    acceptance = DATA_DIR / "acceptance" / "smollm2-135m-lynx-s1-greedy.json"
    timing = DATA_DIR / "codec_timing" / "h100.json"
    rc = main(["sim", "scenario=none", "model=smollm2-135m", "hardware=h100",
               "workload.context_tokens=1024", "workload.output_tokens=16", "codecs=[lynx]",
               f"speculative.acceptance={acceptance.stem}", "samples=1", f"report={report}"])
    assert rc == 0
    listed = {f["path"]: f for f in json.loads(report.read_text())["provenance"]["data_files"]}
    for path in (acceptance, timing):
        entry = listed[str(path.relative_to(ROOT))]
        assert entry["sha256"] == _sha256(path)
        assert entry["size_bytes"] == path.stat().st_size
    # an acceptance model the run did not use is not listed
    assert "data/acceptance/smollm2-135m-int8-s1-greedy.json" not in listed


def test_record_loaded_outside_the_repo_and_rehash_on_change(tmp_path):
    data_files.forget_loaded()
    f = tmp_path / "trace.csv"
    f.write_text("a,b\n1,2\n")
    data_files.record_loaded(f)
    data_files.record_loaded(tmp_path / "missing.json")  # nothing read: nothing listed
    [entry] = data_files.loaded_files()
    assert entry == {"path": str(f.resolve()), "sha256": _sha256(f), "size_bytes": 8}
    f.write_text("a,b\n1,2\n3,4\n")
    data_files.record_loaded(f)
    [entry] = data_files.loaded_files()
    assert entry["sha256"] == _sha256(f) and entry["size_bytes"] == 12


def test_reading_a_data_file_records_it_without_the_loader_asking():
    data_files.forget_loaded()
    path = DATA_DIR / "codec_timing" / "a100.json"
    json.loads(path.read_text())  # a loader that does not call record_loaded
    assert [f["path"] for f in data_files.loaded_files()] == ["data/codec_timing/a100.json"]


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo,
                   check=True, capture_output=True)


def test_git_state_marks_a_dirty_tree(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("one\n")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "commit", "-q", "-m", "c")
    clean = git_state(tmp_path)
    assert len(clean["git_commit"]) == 40 and clean["git_dirty"] is False
    assert clean["git_describe"] == clean["git_commit"][:len(clean["git_describe"])]
    (tmp_path / "f.txt").write_text("two\n")
    dirty = git_state(tmp_path)
    assert dirty["git_dirty"] is True and dirty["git_describe"].endswith("-dirty")
    assert dirty["git_commit"] == clean["git_commit"]


def test_a_copied_tree_names_its_commit(monkeypatch):
    """KVSIM_SOURCE_COMMIT (a tree copied to a GPU machine) wins over whatever .git is
    there, in every report's provenance and in a timing file's measured_with."""
    monkeypatch.setenv("KVSIM_SOURCE_COMMIT", "82b98f9707ec161daa9143e0c4eddd87db04bd9c")
    state = git_state()
    assert state["git_commit"] == "82b98f9707ec161daa9143e0c4eddd87db04bd9c"
    assert state["git_from"] == "KVSIM_SOURCE_COMMIT" and state["git_dirty"] is None
    assert provenance()["git_commit"] == state["git_commit"]


def test_provenance_without_git_says_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr("kvsim.core.report.CODE_DIR", tmp_path)  # not a git checkout
    doc = provenance()
    assert doc["git_commit"] is None and doc["git_describe"] is None
    assert doc["git_dirty"] is None


@pytest.mark.parametrize("fmt", ["png", "pdf", "svg"])
def test_figure_metadata_carries_provenance(tmp_path, fmt):
    from PIL import Image

    from kvsim.plots.style import PROVENANCE_KEY, new_figure, save

    data_files.forget_loaded()
    timing = DATA_DIR / "codec_timing" / "h100.json"
    data_files.record_loaded(timing)
    fig, [ax] = new_figure(2, 2)
    ax.plot([0, 1], [0, 1])
    [path] = save(fig, tmp_path / "f.png", [fmt], 50)
    if fmt == "png":
        doc = json.loads(Image.open(path).text[PROVENANCE_KEY])
    elif fmt == "svg":
        text = path.read_text()
        start = text.index("<dc:description>") + len("<dc:description>")
        import html

        doc = json.loads(html.unescape(text[start:text.index("</dc:description>")]))
    else:
        raw = path.read_bytes()
        assert b"/Subject" in raw and _sha256(timing).encode() in raw
        return
    assert doc["data_files"] == [{"path": "data/codec_timing/h100.json",
                                  "sha256": _sha256(timing),
                                  "size_bytes": timing.stat().st_size}]
    assert "git_describe" in doc
