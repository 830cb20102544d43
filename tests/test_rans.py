"""kvsim.kernels.cachegen.rans: the numba coder gives the reference's words, round-trips, and
refuses every truncated, padded or flipped word."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kernels.cachegen import rans


@st.composite
def chunks(draw):
    """1..4 segments, each with its own alphabet size (2..255) and skewed symbol counts."""
    segs, tables = [], []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(2, 255))
        size = draw(st.integers(0, 400))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        p = rng.dirichlet(np.full(n, draw(st.sampled_from([0.05, 0.5, 5.0]))))
        sym = rng.choice(n, size=size, p=p).astype(np.uint8)
        freq = np.bincount(sym, minlength=n)
        freq[0] += 1  # tables have both ends used
        freq[-1] += 1
        segs.append(sym)
        tables.append(rans.quantize(np.minimum(freq, 65535)))
    return segs, tables


@settings(max_examples=200)
@given(chunks())
def test_kernel_matches_reference_and_round_trips(chunk):
    segs, tables = chunk
    words = rans.encode(segs, tables)
    assert np.array_equal(words, rans.encode_reference(segs, tables))
    counts = [len(s) for s in segs]
    status, flat, hist = rans.decode(words, counts, tables)
    assert status == rans.OK
    assert np.array_equal(flat, np.concatenate(segs))
    for i, s in enumerate(segs):
        assert np.array_equal(hist[i, : len(tables[i][0])],
                              np.bincount(s, minlength=len(tables[i][0])))
    ref_status, ref_segs = rans.decode_reference(words, counts, tables)
    assert ref_status == rans.OK
    assert [list(s) for s in ref_segs] == [list(s) for s in segs]


@settings(max_examples=200)
@given(chunks(), st.integers(0, 2**31), st.sampled_from(["cut", "pad", "flip"]))
def test_damaged_words_are_refused_like_the_reference(chunk, where, how):
    segs, tables = chunk
    words = rans.encode(segs, tables)
    counts = [len(s) for s in segs]
    if how == "cut":
        if not words.size:
            return
        bad = words[: where % words.size]
    elif how == "pad":
        bad = np.append(words, np.uint32(where))
    else:
        if not words.size:
            return
        bad = words.copy()
        bad[where % words.size] ^= np.uint32(1 << (where % 32))
    status, flat, _ = rans.decode(bad, counts, tables)
    ref_status, ref_segs = rans.decode_reference(bad, counts, tables)
    assert status == ref_status
    if how != "flip":  # a flip may decode to other symbols; the codec's histogram check
        assert status != rans.OK  # catches those (tests/test_cachegen.py)
    elif status == rans.OK:
        assert np.array_equal(flat, np.concatenate([np.asarray(s, np.uint8)
                                                    for s in ref_segs]))


def _damage(words: np.ndarray, where: int, how: str) -> np.ndarray:
    if how == "none" or (how != "pad" and not words.size):
        return words
    if how == "cut":
        return words[: where % words.size]
    if how == "pad":
        return np.append(words, np.uint32(where))
    bad = words.copy()
    bad[where % words.size] ^= np.uint32(1 << (where % 32))
    return bad


@settings(max_examples=200)
@given(st.lists(st.tuples(chunks(), st.sampled_from(["none", "cut", "pad", "flip"])),
                min_size=1, max_size=rans.LANES), st.integers(0, 2**31))
def test_lanes_decode_equals_single_decodes(items_how, where):
    """decode_lanes (up to LANES coders interleaved, idle lanes parked) gives each chunk
    decode()'s status, and its symbols and histogram where that is OK, whatever the other
    chunks hold."""
    items = []
    for (segs, tables), how in items_how:
        words = _damage(rans.encode(segs, tables), where, how)
        items.append((words, [len(s) for s in segs], tables))
    for (words, counts, tables), (status, flat, hist) in zip(items, rans.decode_lanes(items),
                                                           strict=True):
        ref_status, ref_flat, ref_hist = rans.decode(words, counts, tables)
        assert status == ref_status
        if status == rans.OK:
            assert np.array_equal(flat, ref_flat)
            assert np.array_equal(hist, ref_hist)


@settings(max_examples=200)
@given(st.lists(st.tuples(chunks(), st.booleans()), min_size=1, max_size=rans.LANES))
def test_lanes_encode_equals_single_encodes(items_empty):
    """encode_lanes (up to LANES coders interleaved) gives each chunk encode()'s words, also
    when a chunk has no symbol or no segment."""
    items = [([], []) if empty else chunk for chunk, empty in items_empty]
    for (segs, tables), words in zip(items, rans.encode_lanes(items), strict=True):
        assert np.array_equal(words, rans.encode(segs, tables))


def test_lanes_refuse_more_chunks_than_lanes():
    chunk = ([np.zeros(3, np.uint8)], [rans.quantize(np.array([3, 1]))])
    with pytest.raises(ValueError, match="1..4 chunks"):
        rans.encode_lanes([chunk] * (rans.LANES + 1))
    with pytest.raises(ValueError, match="1..4 chunks"):
        rans.decode_lanes([])


def test_mulhi64_is_the_high_half_of_the_128_bit_product():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2**64 - 1, 20000, dtype=np.uint64, endpoint=True)
    b = rng.integers(0, 2**64 - 1, 20000, dtype=np.uint64, endpoint=True)
    edges = np.array([0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1], dtype=np.uint64)
    a = np.concatenate([a, np.repeat(edges, edges.size)])
    b = np.concatenate([b, np.tile(edges, edges.size)])
    out = np.empty_like(a)
    rans.mulhi64_kernel(a, b, out)
    assert [int(v) for v in out] == [(int(x) * int(y)) >> 64 for x, y in zip(a, b, strict=True)]


def test_quantize_sums_to_scale_and_keeps_every_used_symbol():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 256))
        freq = rng.integers(0, 65536, size=n) * (rng.random(n) < 0.7)
        freq[int(rng.integers(0, n))] = max(1, freq.max())
        q, start = rans.quantize(freq)
        assert int(q.sum()) == rans.PROB_SCALE
        assert ((q > 0) == (freq > 0)).all()
        assert np.array_equal(start, np.concatenate([[0], np.cumsum(q)[:-1]]))
    # the worst case for the remainder: one heavy symbol and 254 that round up to 1
    freq = np.array([65535] + [1] * 254)
    q, _ = rans.quantize(freq)
    assert int(q.sum()) == rans.PROB_SCALE and q.min() >= 1
    for bad in ([], [0, 0], [1] * 256, [-1, 3]):
        with pytest.raises(rans.RansError):
            rans.quantize(np.array(bad, dtype=np.int64))


def test_empty_chunk_has_no_words():
    assert rans.encode([], []).size == 0
    assert rans.decode(np.zeros(0, np.uint32), [], [])[0] == rans.OK
    assert rans.decode(np.ones(3, np.uint32), [], [])[0] == rans.WORDS_LEFT


def test_reciprocal_update_equals_division_for_every_frequency():
    """The encoder's division-free state update (reciprocals, _mulhi64) equals
    ((x // f) << 16) + x % f + c for every frequency f and states up to the largest one coded
    with f (x < 2^47 f), its ends included."""
    rng = np.random.default_rng(5)
    f = np.arange(1, rans.PROB_SCALE, dtype=np.uint64)
    q = np.zeros((f.size, 256), np.uint32)
    q[:, 0] = f
    start = np.full((f.size, 256), 777, np.uint32)
    rcp, rshift, bias, cmpl = (a[:, 0] for a in rans.reciprocals(q, start))
    lim = f << np.uint64(47)  # (STATE_LOW >> 16) << 32 = 2^47
    for x in (lim - np.uint64(1), np.full(f.size, rans.STATE_LOW, np.uint64),
              *(rng.integers(0, 2**63, f.size, dtype=np.uint64) % lim for _ in range(30))):
        # mulhi64 in Python integers (exact), the update as the kernel computes it (mod 2^64)
        hi = np.array([(int(a) * int(b)) >> 64 for a, b in zip(x, rcp, strict=True)],
                      dtype=np.uint64)
        got = x + bias + (hi >> rshift) * cmpl
        assert np.array_equal(got, ((x // f) << np.uint64(16)) + x % f + np.uint64(777))
        kernel = np.empty_like(x)
        rans.mulhi64_kernel(x, rcp, kernel)
        assert np.array_equal(kernel, hi)


def test_parking_table_is_the_identity():
    """The lanes' parking row (q[0] = 2^16) leaves every state unchanged and never emits."""
    q = np.zeros((1, 256), np.uint32)
    q[0, 0] = rans.PROB_SCALE
    rcp, rshift, bias, cmpl = (int(a[0, 0]) for a in rans.reciprocals(q, np.zeros_like(q)))
    rng = np.random.default_rng(7)
    for x in [rans.STATE_LOW, 2**63 - 1, *(int(v) for v in rng.integers(2**31, 2**63, 1000))]:
        assert x < rans.PROB_SCALE << 47  # never emits: x stays below x_max = 2^63
        assert x + bias + (((x * rcp) >> 64) >> rshift) * cmpl == x
