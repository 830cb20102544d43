"""A decode batch drops the clock breakpoints no member can read any more
(kvsim.sim.batch.DecodeBatch._trim): results are the same to the bit as without dropping,
and the breakpoints held stay bounded."""

from __future__ import annotations

import pytest
from test_sim_golden import CASES, results

from kvsim.sim import batch


@pytest.mark.parametrize("case, extra", [
    ("poisson-anchors-first", []),  # lynx drafts in batches shared with int8 requests
    ("poisson-per-stream-chunked", []),
    ("poisson-anchors-first", ["deserializer=on_demand"]),  # drafting, then a load wait
    ("poisson-anchors-first", ["deserializer=on_arrival"]),
])
def test_dropping_breakpoints_changes_no_result(monkeypatch, case, extra):
    untrimmed = results(CASES[case] + extra)  # 30 requests: far below the threshold
    trims, held = [], []
    trim = batch.DecodeBatch._trim

    def counted(self):
        before = self._bp0
        trim(self)
        trims.append(self._bp0 - before)
        held.append(len(self.bp_t))

    monkeypatch.setattr(batch, "_TRIM_BREAKPOINTS", 4)  # drop at every chance
    monkeypatch.setattr(batch.DecodeBatch, "_trim", counted)
    trimmed = results(CASES[case] + extra)
    assert sum(trims) > 0  # breakpoints were dropped ...
    assert trimmed == pytest.approx(untrimmed, rel=0, abs=0, nan_ok=True)  # ... to no effect
    # what a batch holds after a trim: from its oldest member's phase on (8 per batch here)
    assert max(held) <= 64
