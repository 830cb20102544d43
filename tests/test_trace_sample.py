"""kvsim.scenario.trace_sample: conversations sampled whole, prompts scaled with their blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.scenario.request_trace import RequestTrace, read_trace, replay
from kvsim.scenario.trace_sample import conversation_keys, sample_conversations, scale_blocks


def _trace(rows: list[tuple[float, int, tuple[int, ...]]]) -> RequestTrace:
    t, n, b = zip(*rows, strict=True)
    return RequestTrace(np.asarray(t, dtype=float), np.asarray(n, dtype=np.int64),
                        np.full(len(rows), 7, dtype=np.int64), "test", tuple(b))


# block 0 shared by every request (a system prompt); conversations by their second block:
# 10 (three turns, the third 2,049 tokens), 20 (one turn), 30 (two turns), 40 (two turns)
ROWS = [(0.0, 1000, (0, 10)), (1.0, 600, (0, 20)), (2.0, 1100, (0, 10, 11)),
        (3.0, 900, (0, 30)), (5.0, 2049, (0, 10, 11, 12, 13)), (6.0, 1500, (0, 30, 31)),
        (8.0, 513, (0, 40)), (9.0, 1024, (0, 40))]


def test_scaling_keeps_every_block_and_its_id():
    tr = scale_blocks(_trace(ROWS), 512, 64)
    # ceil(L * 64 / 512): 1000 -> 125, 600 -> 75, 1100 -> 138 (ceil(137.5)), 2049 -> 257
    assert tr.context_tokens.tolist() == [125, 75, 138, 113, 257, 188, 65, 128]
    assert tr.prefix_blocks == _trace(ROWS).prefix_blocks
    # as many blocks of 64 tokens as before of 512
    assert [-(-n // 64) for n in tr.context_tokens.tolist()] == [len(b) for b in ROWS_BLOCKS]
    assert tr.arrival_s.tolist() == [r[0] for r in ROWS]
    assert tr.output_tokens.tolist() == [7] * 8


ROWS_BLOCKS = [r[2] for r in ROWS]


def test_scaling_refuses_blocks_of_another_size_and_traces_without_blocks():
    with pytest.raises(ValueError, match="request 0 has 2 blocks for 1000 tokens.*256"):
        scale_blocks(_trace(ROWS), 256, 32)
    bare = RequestTrace(np.zeros(1), np.ones(1, dtype=np.int64), np.ones(1, dtype=np.int64),
                        "bare.csv")
    with pytest.raises(ValueError, match="bare.csv has no prefix blocks"):
        scale_blocks(bare, 512, 64)


def test_conversations_are_keyed_after_the_prefix_every_request_shares():
    assert conversation_keys(_trace(ROWS)) == [10, 20, 10, 30, 10, 30, 40, 40]
    # no shared prefix: the first block; a request that is only the shared prefix: None
    assert conversation_keys(_trace([(0, 5, (1, 2)), (1, 5, (3,))])) == [1, 3]
    assert conversation_keys(_trace([(0, 5, (1,)), (1, 5, (1, 4))])) == [None, 4]


def test_sampling_takes_whole_conversations_in_order_of_first_arrival():
    tr = _trace(ROWS)
    two = sample_conversations(tr, 2)  # 10 (3 turns) and 30; 20 has one turn
    assert two.arrival_s.tolist() == [0.0, 2.0, 3.0, 5.0, 6.0]
    assert [b[1] for b in two.prefix_blocks] == [10, 10, 30, 10, 30]
    # conversation 10's 2,049-token turn is too long: 30 and 40, arrivals from the first
    short = sample_conversations(tr, 2, max_context_tokens=2048)
    assert short.arrival_s.tolist() == [0.0, 3.0, 5.0, 6.0]
    assert short.context_tokens.tolist() == [900, 1500, 513, 1024]
    assert sample_conversations(tr, 4, min_turns=1).arrival_s.size == 8
    with pytest.raises(ValueError, match="2 conversations with >= 2 requests and prompts "
                                         "<= 2048 tokens, 3 asked"):
        sample_conversations(tr, 3, max_context_tokens=2048)


def test_the_validations_trace_case_replays_whole_mooncake_conversations():
    """The default prefix.trace sample of the shipped conversation trace: every request of a
    sampled conversation in the window is in it, scaled to 64-token blocks."""
    from kvsim.fidelity.validation import PrefixCaseConfig, _prefix_scenario, _prefix_turns

    p = PrefixCaseConfig()
    p.trace.name = "mooncake-conversation"
    turns = _prefix_turns(p)
    window = replay(read_trace("mooncake-conversation"), 600.0, 600.0)
    chosen = {b[1] for _, _, b in turns}
    assert len(chosen) == 4
    # whole conversations: every request of the window with a chosen key is replayed
    assert len(turns) == sum(b[1] in chosen for b in window.prefix_blocks)
    assert all(n <= 2048 and -(-n // 64) == len(b) for _, n, b in turns)
    assert [a for a, _, _ in turns] == sorted(a for a, _, _ in turns) and turns[0][0] == 0.0
    name, codecs, keys = _prefix_scenario(p)
    assert name == "prefix-trace" and "prefix_cache.block_tokens=64" in keys
    assert codecs == ["{preset:int8,label:int8,params:{page_tokens:64}}",
                      "{preset:lynx,label:lynx,params:{page_tokens:64}}"]
