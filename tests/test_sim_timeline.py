"""DecodeTimeline's committed times (two numbers, not a second array), commit_head (the
transport's measured times into that form) and record_columns (many records read once)."""

import math

import numpy as np
import pytest

from kvsim.scenario.speculative import DecodeTimeline, commit_head, plain_decode, speculative_decode


def _spec(accepted: int, tokens: int = 8) -> DecodeTimeline:
    # anchor at 1.0 s, full cache at 1.25 s, 0.1 s drafts, 0.2 s verification, 0.05 s steps
    return speculative_decode(1.0, 1.25, 0.05, 0.1, lambda n: 0.2, 4, lambda n: accepted,
                              tokens)


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_committed_times_are_verification_then_drafted(accepted):
    tl = _spec(accepted)
    assert tl.proposed == 3 and tl.accepted == accepted
    v_end = 1.0 + 3 * 0.1 + 0.2  # drafting ends after 3 steps, then verification
    assert tl.commit_t == pytest.approx(v_end) and tl.commit_count == accepted + 1
    expected = np.concatenate([[tl.commit_t] * (accepted + 1), tl.token_t[accepted + 1:]])
    assert np.array_equal(tl.committed_t, expected)
    # drafts were shown earlier than they are committed; later tokens agree
    assert (tl.token_t[:accepted] < tl.committed_t[:accepted]).all()
    assert [tl.committed_at(k) for k in range(1, 9)] == tl.committed_t.tolist()


def test_plain_decode_commits_as_it_decodes():
    tl = plain_decode(2.0, 0.5, 4)
    assert tl.commit_count == 0 and math.isnan(tl.commit_t)
    assert tl.committed_t is tl.token_t
    assert [tl.committed_at(k) for k in range(1, 5)] == [2.5, 3.0, 3.5, 4.0]


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_commit_head_recovers_a_timeline_from_its_arrays(accepted):
    tl = _spec(accepted)
    count, t = commit_head(tl.token_t, tl.committed_t)
    # token a + 1 is drafted at the end of verification too, so the run stops before it
    assert count == accepted and (count == 0 or t == tl.commit_t)
    back = DecodeTimeline(tl.token_t, tl.start_t, tl.full_t, commit_count=count, commit_t=t)
    assert np.array_equal(back.committed_t, tl.committed_t)
    count, t = commit_head(tl.token_t, tl.token_t.copy())  # nothing drafted
    assert count == 0 and math.isnan(t)


def test_commit_head_refuses_what_a_timeline_cannot_hold():
    drafted = np.array([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="3 committed times for 4 tokens"):
        commit_head(drafted, drafted[:3].copy())
    with pytest.raises(ValueError, match="beyond one verification"):
        commit_head(drafted, np.array([2.5, 2.7, 3.0, 4.0]))


def test_record_columns_read_every_record():
    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig
    from kvsim.scenario.metrics import record_columns
    from kvsim.scenario.variants import variants
    from kvsim.sim.run import Scenario

    cfg, _ = compose("sim", ["scenario=none", "model=llama-3.1-8b", "hardware=h100",
                             "link=25g", "workload=azure-code", "workload.requests=40",
                             "codecs=[lynx]", "granularity=layer"], SimConfig)
    scenario = Scenario(cfg, variants(cfg)[0], cfg.workload.context_tokens,
                        cfg.link.bandwidth_gbps)
    scenario.run()
    recs = scenario.records
    cols = record_columns(recs)
    col = cols.scalars
    assert len({r.context_tokens for r in recs}) > 5
    for i, r in enumerate(recs):
        tl = r.timeline
        assert (col["arrival_t"][i], col["decode_start_t"][i], col["context_tokens"][i]) == \
            (r.arrival_t, r.decode_start_t, r.context_tokens)
        assert (col["tokens"][i], col["first_token_t"][i], col["last_token_t"][i]) == \
            (len(tl.token_t), tl.token_t[0], tl.token_t[-1])
        assert (col["proposed"][i], col["accepted"][i], col["commit_count"][i]) == \
            (tl.proposed, tl.accepted, tl.commit_count)
        assert cols.stream_bytes[i].tolist() == list(r.stream_bytes)
        assert col["total_bytes"][i] == sum(r.stream_bytes)
        assert cols.token_t[i] is tl.token_t and cols.segments[i] is tl.segments
    assert col["proposed"].sum() > 0  # some requests drafted: the commit columns matter
