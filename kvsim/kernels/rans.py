"""rANS entropy coder for CacheGen's chunks: numba kernels + a pure-Python reference.

One coder state codes every segment of a chunk, each segment with its own static
frequency table (the table travels in the chunk). Variant: 64-bit state, 32-bit output
words ("rans64"), probabilities quantized to PROB_BITS = 16 bits.

Frequencies. A segment's table holds u16 counts f[0..n) of its symbols (0 = unused). Both
ends quantize them identically, in integers: q[s] = max(1, f[s] * 2^16 // sum f) for used
symbols, 0 for unused, then the first most frequent symbol absorbs the remainder so that
sum q = 2^16. With n <= 255 symbols the remainder is within (-n, n) and the most frequent
symbol keeps q >= 2^16 / n - 1 - n > 0 (quantize() checks it anyway).

Coding. Encoding runs backwards over the chunk (last segment's last symbol first) from the
state x = L = 2^31; before coding s, while x >= ((L >> 16) << 32) q[s] the low 32 bits are
emitted; then x = (x // q[s]) << 16 + x % q[s] + start[s]. The chunk's words are the final
state (low word, high word), then the emitted words in reverse order. Decoding runs
forwards: slot = x & 0xFFFF, s = the symbol whose [start, start + q) holds slot,
x = q[s] (x >> 16) + slot - start[s], refill a word while x < L. A chunk with no coded
segment has no words.

Integrity (the words are untrusted): the decoder must never read past the words, must use
every word, and must end in the state L it started from (any truncated, padded or flipped
word is caught by one of the three, or by the caller's histogram check).

Speed (same words as the reference): the encoder divides by multiplying with per-symbol
reciprocals (`reciprocals`); encode_pair / decode_pair run two chunks' coders in one loop,
symbol by symbol, so that the CPU overlaps their chains of dependent operations.
"""

from __future__ import annotations

import numba
import numpy as np

PROB_BITS = 16
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 31  # L: the state stays in [L, 2^63) between symbols
MAX_SYMBOLS = 255  # symbols per table (8-bit codes: -127..127)
_JIT = dict(cache=True, nogil=True, error_model="numpy")

# decode status codes (rans_decode's return value)
OK, OUT_OF_WORDS, WORDS_LEFT, BAD_FINAL_STATE, BAD_STATE = 0, 1, 2, 3, 4
STATUS_TEXT = {OUT_OF_WORDS: "coded words end before the last symbol (truncated or corrupt)",
               WORDS_LEFT: "coded words left over after the last symbol (padded or corrupt)",
               BAD_FINAL_STATE: "the coder does not end in its initial state (corrupt words)",
               BAD_STATE: "the initial coder state is out of range (corrupt words)"}


class RansError(ValueError):
    """A frequency table that cannot be quantized (no used symbol, too many symbols)."""


def quantize(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u16 counts [n] (n <= 255, at least one > 0) -> (q uint32 [n] summing to 2^16,
    start uint32 [n]: the cumulative sum before each symbol)."""
    f = np.asarray(freq, dtype=np.int64)
    if f.ndim != 1 or not 1 <= f.size <= MAX_SYMBOLS or (f < 0).any():
        raise RansError(f"a frequency table needs 1..{MAX_SYMBOLS} counts >= 0, got {f.size}")
    total = int(f.sum())
    if total == 0:
        raise RansError("a frequency table with no used symbol")
    q = np.where(f > 0, np.maximum(1, (f * PROB_SCALE) // total), 0)
    top = int(np.argmax(f))  # the first most frequent symbol
    q[top] += PROB_SCALE - int(q.sum())
    if q[top] < 1:  # impossible for n <= 255 (see module docstring); never code with it
        raise RansError("frequency quantization left the most frequent symbol empty")
    start = np.concatenate([[0], np.cumsum(q)[:-1]])
    return q.astype(np.uint32), start.astype(np.uint32)


# ---- reference (pure Python integers; the kernels must give the same words) ---------------------
def encode_reference(symbols: list[np.ndarray], tables: list[tuple[np.ndarray, np.ndarray]]
                     ) -> np.ndarray:
    """symbols[i]: segment i's symbols (ints in 0..len(q_i)), tables[i] = (q_i, start_i).
    Returns the chunk's uint32 words."""
    if not any(len(s) for s in symbols):
        return np.zeros(0, dtype=np.uint32)
    x, out = STATE_LOW, []
    for seg, (q, start) in zip(reversed(symbols), reversed(tables), strict=True):
        for s in reversed([int(v) for v in seg]):
            f, c = int(q[s]), int(start[s])
            x_max = ((STATE_LOW >> PROB_BITS) << 32) * f
            while x >= x_max:
                out.append(x & 0xFFFFFFFF)
                x >>= 32
            x = ((x // f) << PROB_BITS) + (x % f) + c
    return np.array([x & 0xFFFFFFFF, x >> 32, *reversed(out)], dtype=np.uint32)


def decode_reference(words: np.ndarray, counts: list[int],
                     tables: list[tuple[np.ndarray, np.ndarray]]) -> tuple[int, list]:
    """Inverse of encode_reference: (status, [segment symbols])."""
    words = [int(w) for w in words]
    if not sum(counts):
        return (OK if not words else WORDS_LEFT), [[] for _ in counts]
    if len(words) < 2:
        return OUT_OF_WORDS, []
    x, pos, out = words[0] | (words[1] << 32), 2, []
    if not STATE_LOW <= x < (1 << 63):
        return BAD_STATE, []
    for n, (q, start) in zip(counts, tables, strict=True):
        seg = []
        for _ in range(n):
            slot = x & (PROB_SCALE - 1)
            s = int(np.searchsorted(start, slot, side="right")) - 1
            while q[s] == 0:  # unused symbols share their successor's start
                s -= 1
            x = int(q[s]) * (x >> PROB_BITS) + slot - int(start[s])
            while x < STATE_LOW:
                if pos >= len(words):
                    return OUT_OF_WORDS, []
                x = (x << 32) | words[pos]
                pos += 1
            seg.append(s)
        out.append(seg)
    if pos != len(words):
        return WORDS_LEFT, []
    return (OK if x == STATE_LOW else BAD_FINAL_STATE), out


# ---- numba kernels ------------------------------------------------------------------------------
@numba.njit(inline="always", **_JIT)
def _mulhi64(a, b):
    """The high 64 bits of the 128-bit product of uint64 a and b (four 32-bit products)."""
    m32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    a_lo, a_hi = a & m32, a >> s32
    b_lo, b_hi = b & m32, b >> s32
    p0 = a_lo * b_lo
    p1 = a_lo * b_hi
    p2 = a_hi * b_lo
    mid = (p0 >> s32) + (p1 & m32) + (p2 & m32)
    return a_hi * b_hi + (p1 >> s32) + (p2 >> s32) + (mid >> s32)


@numba.njit(**_JIT)
def reciprocals(q, start):
    """Per table entry (q/start uint32 [segments, 256]) the constants of division-free
    coding (F. Giesen's rans64): x -> ((x // f) << 16) + x % f + c equals
    x + bias + (mulhi64(x, rcp) >> rshift) * (2^16 - f) for every state x < 2^63 (exact:
    rcp = ceil(2^(63 + k) / f) for f in (2^(k-1), 2^k], k >= 1; f = 1: rcp = 2^64 - 1,
    bias absorbs the -1). Returns uint64 arrays (rcp, rshift, bias, cmpl) [segments, 256]."""
    segs = q.shape[0]
    rcp = np.zeros((segs, 256), np.uint64)
    rshift = np.zeros((segs, 256), np.uint64)
    bias = np.zeros((segs, 256), np.uint64)
    cmpl = np.zeros((segs, 256), np.uint64)
    for seg in range(segs):
        for s in range(256):
            f = np.uint64(q[seg, s])
            if f == 0:
                continue
            cmpl[seg, s] = np.uint64(PROB_SCALE) - f
            if f < np.uint64(2):
                rcp[seg, s] = np.uint64(0xFFFFFFFFFFFFFFFF)
                bias[seg, s] = np.uint64(start[seg, s]) + np.uint64(PROB_SCALE - 1)
            else:
                k = 0
                while f > (np.uint64(1) << np.uint64(k)):
                    k += 1
                # ceil(2^(k + 63) / f) by long division in two 32-bit steps
                x1 = np.uint64(1) << np.uint64(k + 31)
                t1 = x1 // f
                x0 = (f - np.uint64(1)) + ((x1 % f) << np.uint64(32))
                t0 = x0 // f
                rcp[seg, s] = t0 + (t1 << np.uint64(32))
                rshift[seg, s] = np.uint64(k - 1)
                bias[seg, s] = np.uint64(start[seg, s])
    return rcp, rshift, bias, cmpl


@numba.njit(**_JIT)
def rans_encode(symbols, seg_ends, q, start, out):
    """symbols uint8 [N]: the chunk's coded segments back to back (segment i =
    symbols[seg_ends[i-1]:seg_ends[i]]), q/start uint32 [segments, 256]. Writes the words
    into out (uint32, >= N / 2 + 2 long) and returns how many. The state update divides by
    multiplying with a reciprocal (`reciprocals`: the same state, no 64-bit division)."""
    n = symbols.size
    if n == 0:
        return 0
    cap = out.size
    rcp, rshift, bias, cmpl = reciprocals(q, start)
    x = np.uint64(STATE_LOW)
    w = cap  # emitted words fill out[w:] from the back, so they end up in decode order
    hi = np.uint64((STATE_LOW >> PROB_BITS) << 32)
    for seg in range(seg_ends.size - 1, -1, -1):
        begin = 0 if seg == 0 else seg_ends[seg - 1]
        qs, rs, ss, bs, cs = q[seg], rcp[seg], rshift[seg], bias[seg], cmpl[seg]
        for i in range(seg_ends[seg] - 1, begin - 1, -1):
            s = symbols[i]
            f = np.uint64(qs[s])
            if x >= hi * f:
                w -= 1
                out[w] = np.uint32(x & np.uint64(0xFFFFFFFF))
                x >>= np.uint64(32)
            x = x + bs[s] + (_mulhi64(x, rs[s]) >> ss[s]) * cs[s]
    # state first, then the emitted words: move them down behind it
    count = cap - w
    out[0] = np.uint32(x & np.uint64(0xFFFFFFFF))
    out[1] = np.uint32(x >> np.uint64(32))
    for i in range(count):
        out[2 + i] = out[w + i]
    return count + 2


@numba.njit(inline="always", **_JIT)
def _rows_or_empty(q, rcp, rshift, bias, cmpl):
    """Row 0 of each table (placeholders of the right type; zeros where there is none)."""
    if q.shape[0] == 0:
        z = np.zeros(256, np.uint64)
        return np.zeros(256, np.uint32), z, z, z, z
    return q[0], rcp[0], rshift[0], bias[0], cmpl[0]


@numba.njit(**_JIT)
def rans_encode_pair(sym_a, ends_a, q_a, start_a, out_a, sym_b, ends_b, q_b, start_b, out_b,
                     n_words):
    """rans_encode of two chunks (a, b) at once, symbol by symbol in lockstep (their state
    updates are independent chains, which the CPU overlaps); n_words int64 [2] = each
    chunk's word count, its words in out_a / out_b exactly as rans_encode writes them."""
    n_words[0] = 0
    n_words[1] = 0
    ra, rsa, ba, ca = reciprocals(q_a, start_a)
    rb, rsb, bb, cb = reciprocals(q_b, start_b)
    hi = np.uint64((STATE_LOW >> PROB_BITS) << 32)
    m32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    xa = np.uint64(STATE_LOW)
    xb = np.uint64(STATE_LOW)
    wa = out_a.size  # emitted words fill out[w:] from the back
    wb = out_b.size
    ia = sym_a.size  # symbols still to code: [0, ia), the next is ia - 1
    ib = sym_b.size
    sa = ends_a.size  # the segment of symbol ia - 1 and where it begins
    ga = 0
    sb = ends_b.size
    gb = 0
    # the current segment's table rows (set before the first symbol of each chunk)
    qa, xra, xsa, xba, xca = _rows_or_empty(q_a, ra, rsa, ba, ca)
    qb, xrb, xsb, xbb, xcb = _rows_or_empty(q_b, rb, rsb, bb, cb)
    while ia > 0 or ib > 0:
        if ia > 0 and (sa == ends_a.size or ia <= ga):
            while sa == ends_a.size or ia <= ga:
                sa -= 1
                ga = 0 if sa == 0 else ends_a[sa - 1]
            qa, xra, xsa, xba, xca = q_a[sa], ra[sa], rsa[sa], ba[sa], ca[sa]
        if ib > 0 and (sb == ends_b.size or ib <= gb):
            while sb == ends_b.size or ib <= gb:
                sb -= 1
                gb = 0 if sb == 0 else ends_b[sb - 1]
            qb, xrb, xsb, xbb, xcb = q_b[sb], rb[sb], rsb[sb], bb[sb], cb[sb]
        if ia > 0 and ib > 0:  # both, until the first ends its segment
            for _ in range(min(ia - ga, ib - gb)):
                ia -= 1
                s = sym_a[ia]
                if xa >= hi * np.uint64(qa[s]):
                    wa -= 1
                    out_a[wa] = np.uint32(xa & m32)
                    xa >>= s32
                xa = xa + xba[s] + (_mulhi64(xa, xra[s]) >> xsa[s]) * xca[s]
                ib -= 1
                s = sym_b[ib]
                if xb >= hi * np.uint64(qb[s]):
                    wb -= 1
                    out_b[wb] = np.uint32(xb & m32)
                    xb >>= s32
                xb = xb + xbb[s] + (_mulhi64(xb, xrb[s]) >> xsb[s]) * xcb[s]
        elif ia > 0:
            for _ in range(ia - ga):
                ia -= 1
                s = sym_a[ia]
                if xa >= hi * np.uint64(qa[s]):
                    wa -= 1
                    out_a[wa] = np.uint32(xa & m32)
                    xa >>= s32
                xa = xa + xba[s] + (_mulhi64(xa, xra[s]) >> xsa[s]) * xca[s]
        else:
            for _ in range(ib - gb):
                ib -= 1
                s = sym_b[ib]
                if xb >= hi * np.uint64(qb[s]):
                    wb -= 1
                    out_b[wb] = np.uint32(xb & m32)
                    xb >>= s32
                xb = xb + xbb[s] + (_mulhi64(xb, xrb[s]) >> xsb[s]) * xcb[s]
    for k in range(2):
        out = out_a if k == 0 else out_b
        x = xa if k == 0 else xb
        w = wa if k == 0 else wb
        if (sym_a.size if k == 0 else sym_b.size) == 0:
            continue
        count = out.size - w
        out[0] = np.uint32(x & m32)
        out[1] = np.uint32(x >> s32)
        for i in range(count):
            out[2 + i] = out[w + i]
        n_words[k] = count + 2


@numba.njit(**_JIT)
def histogram(symbols, counts):
    """counts[s] += occurrences of s in symbols (uint8 [N]; counts int64 [256])."""
    for i in range(symbols.size):
        counts[symbols[i]] += 1


@numba.njit(**_JIT)
def rans_decode(words, seg_counts, q, start, out, hist):
    """Decode seg_counts[i] symbols per segment (tables q/start uint32 [segments, 256]) from
    words (uint32) into out (uint8, sum(seg_counts) long, segments back to back), counting
    each segment's symbols into hist (int64 [segments, 256], zeroed by the caller). Returns a
    status (OK, OUT_OF_WORDS, WORDS_LEFT, BAD_FINAL_STATE, BAD_STATE)."""
    total = 0
    for i in range(seg_counts.size):
        total += seg_counts[i]
    if total == 0:
        return OK if words.size == 0 else WORDS_LEFT
    if words.size < 2:
        return OUT_OF_WORDS
    x = np.uint64(words[0]) | (np.uint64(words[1]) << np.uint64(32))
    low = np.uint64(STATE_LOW)
    if x < low or x >= np.uint64(1 << 63):
        return BAD_STATE
    lut = np.empty(PROB_SCALE, dtype=np.uint8)
    mask = np.uint64(PROB_SCALE - 1)
    shift = np.uint64(PROB_BITS)
    n_words = words.size
    pos = 2
    k = 0
    for seg in range(seg_counts.size):
        qs = q[seg]  # this segment's table rows (1-D views: cheaper loads in the loop)
        ss = start[seg]
        hs = hist[seg]
        for s in range(256):
            c = ss[s]
            for j in range(qs[s]):
                lut[c + j] = s
        for _ in range(seg_counts[seg]):
            slot = x & mask
            s = lut[slot]
            x = np.uint64(qs[s]) * (x >> shift) + slot - np.uint64(ss[s])
            if x < low:
                if pos >= n_words:
                    return OUT_OF_WORDS
                x = (x << np.uint64(32)) | np.uint64(words[pos])
                pos += 1
            out[k] = s
            hs[s] += 1
            k += 1
    if pos != words.size:
        return WORDS_LEFT
    return OK if x == low else BAD_FINAL_STATE


@numba.njit(**_JIT)
def _lut_of(q, start, seg_counts):
    """Symbol of each 16-bit slot, per segment with symbols: uint8 [segments, 2^16]."""
    lut = np.zeros((seg_counts.size, PROB_SCALE), dtype=np.uint8)
    for seg in range(seg_counts.size):
        if seg_counts[seg] == 0:
            continue
        for s in range(256):
            c = start[seg, s]
            for j in range(q[seg, s]):
                lut[seg, c + j] = s
    return lut


@numba.njit(**_JIT)
def _start_state(words, seg_counts):
    """(status, state, total symbols): the chunk's initial state checks of rans_decode; a
    status other than OK (or a chunk with no symbol) means there is nothing to decode."""
    total = 0
    for i in range(seg_counts.size):
        total += seg_counts[i]
    if total == 0:
        return (OK if words.size == 0 else WORDS_LEFT), np.uint64(0), 0
    if words.size < 2:
        return OUT_OF_WORDS, np.uint64(0), 0
    x = np.uint64(words[0]) | (np.uint64(words[1]) << np.uint64(32))
    if x < np.uint64(STATE_LOW) or x >= np.uint64(1 << 63):
        return BAD_STATE, np.uint64(0), 0
    return OK, x, total


@numba.njit(inline="always", **_JIT)
def _end_status(x, pos, words):
    """A chunk's status after its last symbol: every word used, back in the state L."""
    if pos != words.size:
        return WORDS_LEFT
    return OK if x == np.uint64(STATE_LOW) else BAD_FINAL_STATE


@numba.njit(**_JIT)
def rans_decode_pair(words_a, counts_a, q_a, start_a, out_a, hist_a,
                     words_b, counts_b, q_b, start_b, out_b, hist_b, status):
    """rans_decode of two chunks (a, b) at once, symbol by symbol in lockstep: the two
    coders' chains of dependent operations (table look-up, multiply, refill) are
    independent, so the CPU overlaps them. Each chunk's output, histogram and status
    (status int64 [2]) are exactly rans_decode's; a chunk that fails stops (its output is
    then undefined), the other goes on alone."""
    st_a, xa, ta = _start_state(words_a, counts_a)
    st_b, xb, tb = _start_state(words_b, counts_b)
    lut_a = _lut_of(q_a, start_a, counts_a)
    lut_b = _lut_of(q_b, start_b, counts_b)
    low = np.uint64(STATE_LOW)
    mask = np.uint64(PROB_SCALE - 1)
    shift = np.uint64(PROB_BITS)
    w32 = np.uint64(32)
    na = words_a.size
    nb = words_b.size
    pa = 2
    pb = 2
    ka = 0
    kb = 0
    sa = -1  # current segment and the end of its symbols
    ea = 0
    sb = -1
    eb = 0
    fin_a = st_a != OK or ta == 0  # nothing to decode: the status is final
    fin_b = st_b != OK or tb == 0
    if fin_a:
        ta = 0
    if fin_b:
        tb = 0
    la, qa, ca, ha = lut_a[0], q_a[0], start_a[0], hist_a[0]
    lb, qb, cb, hb = lut_b[0], q_b[0], start_b[0], hist_b[0]
    while ka < ta or kb < tb:
        if ka == ea and ka < ta:
            while ka == ea:
                sa += 1
                ea += counts_a[sa]
            la, qa, ca, ha = lut_a[sa], q_a[sa], start_a[sa], hist_a[sa]
        if kb == eb and kb < tb:
            while kb == eb:
                sb += 1
                eb += counts_b[sb]
            lb, qb, cb, hb = lut_b[sb], q_b[sb], start_b[sb], hist_b[sb]
        # both run until the first of them ends its segment (or chunk)
        n = min(ea - ka if ka < ta else eb - kb, eb - kb if kb < tb else ea - ka)
        if ka < ta and kb < tb:
            for _ in range(n):
                slot = xa & mask
                s = la[slot]
                xa = np.uint64(qa[s]) * (xa >> shift) + slot - np.uint64(ca[s])
                if xa < low:
                    if pa >= na:
                        st_a = OUT_OF_WORDS
                        break
                    xa = (xa << w32) | np.uint64(words_a[pa])
                    pa += 1
                out_a[ka] = s
                ha[s] += 1
                ka += 1
                slot2 = xb & mask
                s2 = lb[slot2]
                xb = np.uint64(qb[s2]) * (xb >> shift) + slot2 - np.uint64(cb[s2])
                if xb < low:
                    if pb >= nb:
                        st_b = OUT_OF_WORDS
                        break
                    xb = (xb << w32) | np.uint64(words_b[pb])
                    pb += 1
                out_b[kb] = s2
                hb[s2] += 1
                kb += 1
        elif ka < ta:
            for _ in range(n):
                slot = xa & mask
                s = la[slot]
                xa = np.uint64(qa[s]) * (xa >> shift) + slot - np.uint64(ca[s])
                if xa < low:
                    if pa >= na:
                        st_a = OUT_OF_WORDS
                        break
                    xa = (xa << w32) | np.uint64(words_a[pa])
                    pa += 1
                out_a[ka] = s
                ha[s] += 1
                ka += 1
        else:
            for _ in range(n):
                slot2 = xb & mask
                s2 = lb[slot2]
                xb = np.uint64(qb[s2]) * (xb >> shift) + slot2 - np.uint64(cb[s2])
                if xb < low:
                    if pb >= nb:
                        st_b = OUT_OF_WORDS
                        break
                    xb = (xb << w32) | np.uint64(words_b[pb])
                    pb += 1
                out_b[kb] = s2
                hb[s2] += 1
                kb += 1
        if st_a != OK:
            ka = ta = 0
        if st_b != OK:
            kb = tb = 0
    status[0] = st_a if fin_a or st_a != OK else _end_status(xa, pa, words_a)
    status[1] = st_b if fin_b or st_b != OK else _end_status(xb, pb, words_b)


def table_arrays(tables: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """[(q, start)] per segment -> q, start uint32 [segments, 256] (zero beyond each table)."""
    q = np.zeros((len(tables), 256), dtype=np.uint32)
    start = np.zeros((len(tables), 256), dtype=np.uint32)
    for i, (qi, si) in enumerate(tables):
        q[i, : qi.size] = qi
        start[i, : si.size] = si
    return q, start


def encode(symbols: list[np.ndarray], tables: list[tuple[np.ndarray, np.ndarray]]
           ) -> np.ndarray:
    """The kernel with the reference's interface: uint32 words of one chunk."""
    flat = np.concatenate([np.asarray(s, dtype=np.uint8) for s in symbols]) if symbols else \
        np.zeros(0, dtype=np.uint8)
    ends = np.cumsum([len(s) for s in symbols]).astype(np.int64)
    q, start = table_arrays(tables)
    out = np.empty(flat.size // 2 + 4, dtype=np.uint32)  # <= 16 bits per symbol + state
    n = rans_encode(flat, ends, q, start, out)
    return out[:n].copy()


def decode(words: np.ndarray, counts: list[int], tables: list[tuple[np.ndarray, np.ndarray]]
           ) -> tuple[int, np.ndarray, np.ndarray]:
    """The kernel with the reference's interface: (status, uint8 symbols back to back, int64
    histogram [segments, 256] of each segment's symbols)."""
    q, start = table_arrays(tables)
    out = np.empty(int(sum(counts)), dtype=np.uint8)
    hist = np.zeros((len(tables), 256), dtype=np.int64)
    status = rans_decode(np.ascontiguousarray(words, dtype=np.uint32),
                         np.asarray(counts, dtype=np.int64), q, start, out, hist)
    return int(status), out, hist


def decode_pair(chunks: list[tuple[np.ndarray, list[int], list[tuple[np.ndarray, np.ndarray]]]]
                ) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """decode() of two chunks [(words, counts, tables)] * 2 in one interleaved kernel call
    (rans_decode_pair): the same results, about twice the symbols per second."""
    args = []
    for words, counts, tables in chunks:
        q, start = table_arrays(tables)
        args += [np.ascontiguousarray(words, dtype=np.uint32), np.asarray(counts, dtype=np.int64),
                 q, start, np.empty(int(sum(counts)), dtype=np.uint8),
                 np.zeros((len(tables), 256), dtype=np.int64)]
    status = np.zeros(2, dtype=np.int64)
    rans_decode_pair(*args, status)
    return [(int(status[i]), args[6 * i + 4], args[6 * i + 5]) for i in range(2)]


def encode_pair(chunks: list[tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]]
                ) -> list[np.ndarray]:
    """encode() of two chunks [(symbols, tables)] * 2 in one interleaved kernel call
    (rans_encode_pair): the same words."""
    args = []
    for symbols, tables in chunks:
        flat = (np.concatenate([np.asarray(s, dtype=np.uint8) for s in symbols]) if symbols
                else np.zeros(0, dtype=np.uint8))
        ends = np.cumsum([len(s) for s in symbols]).astype(np.int64)
        q, start = table_arrays(tables)
        args += [flat, ends, q, start, np.empty(flat.size // 2 + 4, dtype=np.uint32)]
    n_words = np.zeros(2, dtype=np.int64)
    rans_encode_pair(*args, n_words)
    return [args[5 * i + 4][: n_words[i]].copy() for i in range(2)]
