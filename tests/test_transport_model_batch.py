"""The real-decode batch (kvsim.transport.model_batch): one forward over every member's
cache gives each member the logits its own batch-1 forwards would, through joins, leaves,
ragged feeds and verification crops."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvsim.kv.capture import prefill
from kvsim.model.tiny import tiny_llama
from kvsim.transport.model_batch import ModelBatch, ModelWork, _Rows

ATOL = 1e-4  # logits: the same sums as batch 1, in another order
WAIT_S = 30.0


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Member:
    """A request as the batch sees it: its own cache (as loaded) and the tokens its cache
    logically holds, from which the batch-1 reference is recomputed."""

    def __init__(self, model, seed: int, tokens: int) -> None:
        self.model = model
        self.seq = _ids(seed, tokens)
        self.cache, _ = prefill(model, self.seq)

    def reference(self, fed: list[int]) -> torch.Tensor:
        """Logits [fed, vocab] of a fresh batch-1 forward of `fed` after the sequence."""
        cache, _ = prefill(self.model, self.seq)
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([fed]), past_key_values=cache,
                              use_cache=True).logits[0]


def _step(rows: _Rows, feeds: dict[Member, list[int]]) -> None:
    """One batched step; each member's logits against its reference, then its sequence
    extended by what it fed."""
    works = {m: ModelWork(m.cache, tuple(fed)) for m, fed in feeds.items()}
    refs = {m: m.reference(fed) for m, fed in feeds.items()}
    rows.arrange(works)
    got = rows.forward(works)
    assert set(got) == set(feeds)
    for m, fed in feeds.items():
        assert got[m].shape == refs[m].shape
        torch.testing.assert_close(got[m], refs[m], atol=ATOL, rtol=0)
        m.seq += fed


def test_rows_match_each_members_batch1_forwards_through_joins_leaves_and_crops(model):
    a, b, c = Member(model, 1, 37), Member(model, 2, 20), Member(model, 3, 29)
    rows = _Rows(model)
    _step(rows, {a: [5]})
    assert rows.cache is a.cache and rows.valid is None  # alone: its own cache, no copy
    # b joins with a shorter cache and verifies 3 drafts while a decodes one token
    _step(rows, {a: [6], b: [7, 8, 9, 10]})
    assert rows.valid is not None and rows.valid.shape[0] == 2
    # b accepted 1 of its 3 drafts: first token + 1 draft stay, the rest is masked
    rows.crop(b, 20 + 2)
    b.seq = b.seq[:22]
    _step(rows, {a: [11], b: [12]})
    # a leaves (done), c joins: the rows are rebuilt, b's gap packed away
    _step(rows, {b: [13], c: [14, 15]})
    assert [r.member for r in rows.rows] == [b, c]
    assert int(rows.valid[0].sum()) == len(b.seq) and int(rows.valid[1].sum()) == len(c.seq)
    # c alone again: one row, no mask, real crops
    _step(rows, {c: [16]})
    assert rows.valid is None and int(rows.cache.get_seq_length()) == len(c.seq)
    rows.crop(c, len(c.seq) - 1)
    c.seq = c.seq[:-1]
    _step(rows, {c: [17]})


def test_a_member_back_on_another_cache_gets_a_new_row(model):
    """Drafting ends on the anchor-only cache and verification begins on the full one: same
    member, another cache object, so its row is built anew from that cache."""
    a, b = Member(model, 4, 25), Member(model, 5, 31)
    rows = _Rows(model)
    _step(rows, {a: [1], b: [2]})
    full = Member(model, 6, 40)  # a's full cache (another prompt stands in for it)
    a.cache, a.seq = full.cache, list(full.seq)
    _step(rows, {a: [3, 4, 5], b: [6]})
    assert [r.member for r in rows.rows] == [b, a]  # kept rows first, then the new
    assert int(rows.valid[1].sum()) == len(a.seq)


def test_a_crop_beyond_the_row_is_refused(model):
    a, b = Member(model, 7, 12), Member(model, 8, 15)
    rows = _Rows(model)
    _step(rows, {a: [1], b: [2]})
    with pytest.raises(ValueError, match="cannot crop"):
        rows.crop(a, 100)
    with pytest.raises(RuntimeError, match="no row"):
        rows.crop("someone else", 3)


def _greedy(m: Member, first: int, steps: int) -> list[int]:
    """Batch-1 greedy tokens after feeding `first`, each fed back (the reference)."""
    seq, fed, out = list(m.seq), first, []
    for _ in range(steps):
        cache, _ = prefill(m.model, seq)
        with torch.no_grad():
            logits = m.model(input_ids=torch.tensor([[fed]]), past_key_values=cache,
                             use_cache=True).logits[0, -1]
        seq.append(fed)
        fed = int(logits.argmax())
        out.append(fed)
    return out


def test_the_batch_steps_its_members_together(model):
    """Three decode threads: they share forwards (a member that posts while a step runs
    joins the next), and each gets its own greedy tokens."""
    steps = 12
    members = [Member(model, 10 + i, 18 + 7 * i) for i in range(3)]
    want = {id(m): _greedy(m, 40 + i, steps) for i, m in enumerate(members)}
    batch = ModelBatch(model, max_batch=3, wait_timeout_s=WAIT_S)
    got: dict[int, list[int]] = {}
    together = threading.Barrier(3)

    def run(i: int, m: Member) -> None:
        assert batch.take_slot()
        together.wait(WAIT_S)
        fed, out = 40 + i, []
        for _ in range(steps):
            tokens = batch.forward(m, m.cache, [fed])
            assert tokens is not None
            fed = tokens[0]
            out.append(fed)
        got[id(m)] = out
        batch.pause(m)
        batch.give_slot()

    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert got == want
    # (how many share each step depends on the threads' timing; that some did, not)
    assert batch.widest >= 2 and batch.steps < 3 * steps


def test_a_failed_forward_fails_its_members_and_the_batch_goes_on(model):
    batch = ModelBatch(model, max_batch=2, wait_timeout_s=WAIT_S)
    a = Member(model, 20, 10)
    other = Member(tiny_llama(seed=3, hidden=32, q_heads=2, kv_heads=1), 21, 10)
    with pytest.raises(RuntimeError, match="decode batch failed"):
        batch.forward("bad", other.cache, [3])  # another model's cache: the forward fails
    batch.pause("bad")
    want = a.reference([3]).argmax(dim=-1).tolist()
    assert batch.forward(a, a.cache, [3]) == want
    with pytest.raises(ValueError, match="at least one token"):
        batch.forward(a, a.cache, [])


def test_token_ids_beyond_the_vocabulary_fail_their_member_alone(model):
    """Checked before the post: a shared forward would fail every member with it."""
    batch = ModelBatch(model, max_batch=2, wait_timeout_s=WAIT_S)
    a = Member(model, 22, 10)
    with pytest.raises(ValueError, match="token ids must be in 0..255"):
        batch.forward(a, a.cache, [256])
    assert batch.steps == 0


def test_a_member_dropped_from_its_row_cannot_step_on_that_cache_again(model):
    """The stall guard drops a member that neither stepped nor paused; the others' next
    step takes its row. Posting that cache again would decode on entries the row had and
    the cache lacks: refused. On another cache (a new phase) it is welcome."""
    batch = ModelBatch(model, max_batch=2, wait_timeout_s=WAIT_S, stall_s=0.2)
    a, b = Member(model, 23, 12), Member(model, 24, 14)
    done = threading.Event()

    def other() -> None:  # b steps on while a stalls
        while not done.is_set():
            assert batch.forward(b, b.cache, [7]) is not None
        batch.pause(b)

    assert batch.forward(a, a.cache, [5]) is not None
    thread = threading.Thread(target=other)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not batch._dropped.get(a) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="was dropped from the batch"):
        batch.forward(a, a.cache, [6])
    fresh = Member(model, 25, 9)
    assert batch.forward(a, fresh.cache, [6]) == fresh.reference([6]).argmax(dim=-1).tolist()
    done.set()
    thread.join(WAIT_S)


def test_a_member_cancelled_mid_step_leaves_nothing_behind(model):
    """Its step goes on for the others; its tokens are not kept for it."""
    batch = ModelBatch(model, max_batch=2, wait_timeout_s=WAIT_S)
    a = Member(model, 26, 12)
    started, release = threading.Event(), threading.Event()
    forward = batch._rows.forward

    def slow_forward(works):
        started.set()
        release.wait(WAIT_S)
        return forward(works)

    batch._rows.forward = slow_forward
    got: list = []
    thread = threading.Thread(target=lambda: got.append(
        batch.forward(a, a.cache, [4], cancelled=lambda: "dropped" if started.is_set()
                      else "")))
    thread.start()
    assert started.wait(WAIT_S)
    thread.join(WAIT_S)  # the member gave up at once (its cancel poll)
    assert got == [None]
    release.set()
    deadline = time.monotonic() + WAIT_S
    while batch.steps < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert batch.steps == 1
    with batch._cond:
        assert a not in batch._results and a not in batch._released_t
