"""What each job of a sweep pays: provenance asks git once per process, not once per report."""

from __future__ import annotations

import kvsim.core.report as report


def test_provenance_asks_git_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(report, "_git", lambda args, cwd: calls.append(args) or "abc1234")
    report._code_git_state.cache_clear()
    try:
        docs = [report.provenance() for _ in range(3)]
        docs[0]["git_describe"] = "changed by a caller"  # each caller gets its own copy
        assert report.git_state()["git_describe"] == "abc1234"
    finally:
        report._code_git_state.cache_clear()
    assert len(calls) == 2  # rev-parse and describe, once
    assert docs[2]["git_commit"] == "abc1234" and docs[2]["git_dirty"] is False
