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
reciprocals (`reciprocals`, one widening multiply: `_mulhi64`); encode_lanes /
decode_lanes run up to LANES chunks' coders in one loop, symbol by symbol, so that the CPU
overlaps their chains of dependent operations (a coder alone waits on its table look-up
and multiply every symbol); emitting and refilling words are branch-free (they come every
few symbols at random, so a branch on them would often be mispredicted). The time per
symbol with one, two and four coders interleaved is on the docs' CacheGen page.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

PROB_BITS = 16
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 31  # L: the state stays in [L, 2^63) between symbols
MAX_SYMBOLS = 255  # symbols per table (8-bit codes: -127..127)
LANES = 4  # chunks coded at once by encode_lanes / decode_lanes (interleaved coders)
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
@intrinsic
def _mulhi64(typingctx, a, b):
    """The high 64 bits of the 128-bit product of uint64 a and b: one widening multiply in
    LLVM IR (numba has no 128-bit integer type; the four 32-bit products it would take
    instead would be a third of the encoder's chain of dependent operations per symbol)."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        wide = ir.IntType(128)
        x, y = (context.cast(builder, v, t, types.uint64)
                for v, t in zip(args, signature.args, strict=True))
        product = builder.mul(builder.zext(x, wide), builder.zext(y, wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))

    return sig, codegen


@numba.njit(**_JIT)
def mulhi64_kernel(a, b, out):
    """out[i] = the high 64 bits of a[i] * b[i] (uint64 arrays): _mulhi64 for tests."""
    for i in range(a.size):
        out[i] = _mulhi64(a[i], b[i])


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
def _enc_advance(i, k, x, w, seg, it, counts, out, out_at, n_words, scratch_k, park_row):
    """Lane i has coded every symbol of its segment, back to its first (or starts:
    seg = counts.shape[1]): the previous segment with symbols, or, at the chunk's start,
    its words finished (state first, then the emitted words moved down behind it,
    n_words[i]) and the lane parked (see rans_encode_lanes). w: its write position
    (uint64). Returns the lane's (state, write position, segment, its first k, table row,
    k)."""
    segs = counts.shape[1]
    seg -= 1
    while seg >= 0 and counts[i, seg] == 0:
        seg -= 1
    if seg >= 0:
        return x, w, seg, k - counts[i, seg], i * segs + seg, k
    o0 = out_at[i]
    count = out_at[i + 1] - np.int64(w)
    out[o0] = np.uint32(x & np.uint64(0xFFFFFFFF))
    out[o0 + 1] = np.uint32(x >> np.uint64(32))
    for j in range(count):
        out[o0 + 2 + j] = out[np.int64(w) + j]
    n_words[i] = count + 2
    # parked: the identity row, zero symbols from the scratch, writes to the last word
    return (np.uint64(STATE_LOW), np.uint64(out.size), seg, -(np.int64(1) << np.int64(62)),
            park_row + i, scratch_k - it)


@numba.njit(inline="always", **_JIT)
def _enc_step(x, w, s, q_row, rcp_row, shift_row, bias_row, cmpl_row, out):
    """Code symbol s of a lane (1-D views of its segment's tables, indexed by the uint8
    symbol; w uint64: no wraparound test): (state, write position) after it. The low word
    is stored whatever the state, and kept (w - 1) only if it is emitted: branch-free (an
    emission comes every few symbols at random)."""
    emit = np.uint64(x >= (np.uint64(q_row[s]) << np.uint64(PROB_BITS + 31)))  # x_max
    w = w - np.uint64(1)
    out[w] = np.uint32(x & np.uint64(0xFFFFFFFF))
    x = x >> (emit << np.uint64(5))
    x = x + bias_row[s] + (_mulhi64(x, rcp_row[s]) >> shift_row[s]) * cmpl_row[s]
    return x, w + (np.uint64(1) - emit)


@numba.njit(**_JIT)
def rans_encode_lanes(symbols, sym_at, counts, q, start, out, out_at, n_words):
    """rans_encode of n <= LANES chunks at once, symbol by symbol in lockstep (their state
    updates are independent chains, which the CPU overlaps). Chunk i: its coded segments
    back to back in symbols[sym_at[i]:sym_at[i + 1]] (segment j has counts[i, j] symbols;
    int64 [n, segments], zero padded), table of segment j in row i * segments + j of q /
    start (uint32 [n * segments + LANES, 256]; the last LANES rows are the lanes' parking
    tables: q[0] = 2^16, the identity step that never emits), its words into
    out[out_at[i]:] exactly as rans_encode writes them (the region is len / 2 + 4 words
    long; out has one more word at the end, the parked lanes' scratch), their number into
    n_words[i] (int64 [n]). symbols holds the longest chunk's length of zeros after
    sym_at[n]: the parked lanes' symbols. Every symbol must have q > 0 in its table (as
    rans_encode: a table built from the symbols' own counts; a zero q would emit a word per
    symbol past the chunk's region). Lanes run in rounds: each round until the first
    lane reaches its segment's first symbol, on 1-D views of the lanes' current tables."""
    n = counts.shape[0]
    segs = counts.shape[1]
    if n > LANES or q.shape[0] != n * segs + LANES or start.shape[0] != q.shape[0] \
            or sym_at.size != n + 1 or out_at.size != n + 1 or n_words.size != n \
            or out.size < out_at[n] + 1:
        raise ValueError("rans_encode_lanes: inconsistent array shapes (see encode_lanes)")
    rcp, rshift, bias, cmpl = reciprocals(q, start)
    park_row = q.shape[0] - LANES
    big = np.int64(1) << np.int64(62)
    longest = 0
    for i in range(n):
        n_words[i] = 0
        longest = max(longest, sym_at[i + 1] - sym_at[i])
    scratch_k = symbols.size  # a parked lane's k: scratch_k - it, then down by one a step
    # per lane: state x, write position w (uint64), segment g, its first symbol b, row r,
    # next k (the symbol after the next one to code)
    xs = np.full(LANES, np.uint64(STATE_LOW), np.uint64)
    ws = np.full(LANES, np.uint64(out.size), np.uint64)
    bs = np.full(LANES, -big, np.int64)
    rs = np.zeros(LANES, np.int64)
    ks = np.full(LANES, scratch_k, np.int64)
    for i in range(LANES):
        rs[i] = park_row + i
        if i < n and sym_at[i + 1] > sym_at[i]:
            ws[i] = np.uint64(out_at[i + 1])
            ks[i] = sym_at[i + 1]
            bs[i] = ks[i]  # k == b: the first _enc_advance picks the last segment
    x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
    w0, w1, w2, w3 = ws[0], ws[1], ws[2], ws[3]
    g0 = g1 = g2 = g3 = segs
    b0, b1, b2, b3 = bs[0], bs[1], bs[2], bs[3]
    r0, r1, r2, r3 = rs[0], rs[1], rs[2], rs[3]
    k0, k1, k2, k3 = ks[0], ks[1], ks[2], ks[3]
    it = 0  # steps run so far
    while True:
        # segment changes; then every lane runs until the first of them ends its segment
        if k0 == b0:
            x0, w0, g0, b0, r0, k0 = _enc_advance(0, k0, x0, w0, g0, it, counts, out, out_at,
                                                  n_words, scratch_k, park_row)
        if k1 == b1:
            x1, w1, g1, b1, r1, k1 = _enc_advance(1, k1, x1, w1, g1, it, counts, out, out_at,
                                                  n_words, scratch_k, park_row)
        if k2 == b2:
            x2, w2, g2, b2, r2, k2 = _enc_advance(2, k2, x2, w2, g2, it, counts, out, out_at,
                                                  n_words, scratch_k, park_row)
        if k3 == b3:
            x3, w3, g3, b3, r3, k3 = _enc_advance(3, k3, x3, w3, g3, it, counts, out, out_at,
                                                  n_words, scratch_k, park_row)
        run = min(min(k0 - b0, k1 - b1), min(k2 - b2, k3 - b3))
        if run > longest:  # every lane parked
            break
        # this round's symbols, reversed (coding runs backwards): view[j] = symbol k - 1 - j
        s0, s1 = symbols[k0 - run:k0][::-1], symbols[k1 - run:k1][::-1]
        s2, s3 = symbols[k2 - run:k2][::-1], symbols[k3 - run:k3][::-1]
        q0, t0, h0, z0, c0 = q[r0], rcp[r0], rshift[r0], bias[r0], cmpl[r0]
        q1, t1, h1, z1, c1 = q[r1], rcp[r1], rshift[r1], bias[r1], cmpl[r1]
        q2, t2, h2, z2, c2 = q[r2], rcp[r2], rshift[r2], bias[r2], cmpl[r2]
        q3, t3, h3, z3, c3 = q[r3], rcp[r3], rshift[r3], bias[r3], cmpl[r3]
        for j in range(run):
            x0, w0 = _enc_step(x0, w0, s0[j], q0, t0, h0, z0, c0, out)
            x1, w1 = _enc_step(x1, w1, s1[j], q1, t1, h1, z1, c1, out)
            x2, w2 = _enc_step(x2, w2, s2[j], q2, t2, h2, z2, c2, out)
            x3, w3 = _enc_step(x3, w3, s3[j], q3, t3, h3, z3, c3, out)
        k0 -= run
        k1 -= run
        k2 -= run
        k3 -= run
        it += run


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
    status (OK, OUT_OF_WORDS, WORDS_LEFT, BAD_FINAL_STATE, BAD_STATE). One coder: decode()'s
    kernel, the reference rans_decode_lanes is tested against (tests/test_rans.py)."""
    status, x, total = _start_state(words, seg_counts)
    if status != OK or total == 0:
        return status
    low = np.uint64(STATE_LOW)
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
        _fill_lut(qs, ss, lut)
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
    return _end_status(x, pos, n_words)


@numba.njit(**_JIT)
def _fill_lut(q, start, lut):
    """The symbol of each 16-bit slot (lut uint8 [2^16]) under one segment's table (q / start
    uint32 [256], q summing to 2^16)."""
    for s in range(256):
        c = start[s]
        for j in range(q[s]):
            lut[c + j] = s


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
def _end_status(x, pos, n_words):
    """A chunk's status after its last symbol: every word used (pos: the next one), back
    in the state L."""
    if pos != n_words:
        return WORDS_LEFT
    return OK if x == np.uint64(STATE_LOW) else BAD_FINAL_STATE


@numba.njit(inline="always", **_JIT)
def _refill(x, words, pos, last):
    """Branch-free refill: (x << 32 | words[pos], pos + 1) if x < L, else (x, pos) (a refill
    comes every few symbols at random: a branch on it would often be mispredicted). The
    word is read at min(pos, last), last = words.size - 1 (pos and last uint64: no
    wraparound test); pos > words.size afterwards means the words ran out (OUT_OF_WORDS)."""
    need = np.uint64(x < np.uint64(STATE_LOW))
    w = np.uint64(words[pos if pos < last else last])
    return (x << (need << np.uint64(5))) | (w & (np.uint64(0) - need)), pos + need


@numba.njit(inline="always", **_JIT)
def _dec_advance(i, k, x, p, n_words, seg, it, counts, q, start, lut, out_end, status):
    """Lane i has decoded every symbol of its segment (or starts: seg = -1): the next
    segment with symbols (its table into look-up row lut[i]), or, at the chunk's end or on
    an error, status[i] and the lane parked (see rans_decode_lanes). p / n_words: its next
    word and word count (uint64). Returns the lane's (state, segment, its end k, table row,
    look-up row, k)."""
    segs = counts.shape[1]
    if p > n_words:  # a refill past the last word
        status[i] = OUT_OF_WORDS
    else:
        seg += 1
        while seg < segs and counts[i, seg] == 0:
            seg += 1
        if seg < segs:
            row = i * segs + seg
            _fill_lut(q[row], start[row], lut[i])
            return x, seg, k + counts[i, seg], row, i, k
        status[i] = _end_status(x, p, n_words)
    # parked: its parking row (the identity), look-up row LANES (zeros), scratch output
    return (np.uint64(STATE_LOW), seg, np.int64(1) << np.int64(62), q.shape[0] - LANES + i,
            LANES, out_end + it)


@numba.njit(inline="always", **_JIT)
def _dec_step(x, p, last, j, q_row, c_row, lut, out, hist_row, words):
    """One symbol of one lane into out[j] (1-D views of its segment's tables: indexed by
    unsigned values or the loop counter, the loads need no wraparound test): (state, word
    position) after it; p and last are unsigned too."""
    slot = x & np.uint64(PROB_SCALE - 1)
    s = lut[slot]
    x = np.uint64(q_row[s]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(c_row[s])
    out[j] = s
    hist_row[s] += 1
    return _refill(x, words, p, last)


@numba.njit(**_JIT)
def rans_decode_lanes(words, word_at, counts, q, start, out, out_at, hist, status):
    """rans_decode of n <= LANES chunks at once, symbol by symbol in lockstep: their coders'
    chains of dependent operations (table look-up, multiply, refill) are independent, so
    the CPU overlaps them. Chunk i: words[word_at[i]:word_at[i + 1]] (words ends with one
    sentinel word after word_at[n]), counts[i] (int64 [n, segments], zero padded), table of
    its segment j in row i * segments + j of q / start (uint32 [n * segments + LANES, 256];
    the last LANES rows are the lanes' parking tables: q[0] = 2^16, the identity step), its
    symbols into out[out_at[i]:out_at[i + 1]] (out: uint8, out_at[n] + the longest chunk's
    symbols long: the tail is the parked lanes' scratch), the histogram of its segment j
    into hist row i * segments + j (int64 [n * segments + LANES, 256], zeroed), its status
    into status[i]: each exactly rans_decode's (a chunk that fails stops; its output is then
    undefined). A lane without a chunk, or whose chunk has ended, is parked: it runs the
    identity step (state L, no refill) into the scratch. Lanes run in rounds: each round
    until the first lane ends its segment, on 1-D views of the lanes' current tables."""
    n = counts.shape[0]
    if n > LANES or q.shape[0] != n * counts.shape[1] + LANES or start.shape != q.shape \
            or hist.shape[0] != q.shape[0] or word_at.size != n + 1 or out_at.size != n + 1 \
            or status.size != n or words.size < word_at[n] + 1:
        raise ValueError("rans_decode_lanes: inconsistent array shapes (see decode_lanes)")
    lut = np.zeros((LANES + 1, PROB_SCALE), np.uint8)  # row LANES: the parked lanes'
    out_end = out_at[n]
    big = np.int64(1) << np.int64(62)
    sentinel = words[words.size - 1:]
    lane_words = [sentinel] * LANES
    xs = np.full(LANES, np.uint64(STATE_LOW), np.uint64)
    ends = np.full(LANES, big, np.int64)
    ks = np.full(LANES, out_end, np.int64)
    longest = 0
    for i in range(n):
        lw = words[word_at[i]:word_at[i + 1]]
        st, x, total = _start_state(lw, counts[i])
        status[i] = st
        if st == OK and total > 0:
            lane_words[i] = lw
            xs[i] = x
            ks[i] = out_at[i]
            ends[i] = out_at[i]  # k == end: the first _dec_advance picks the first segment
            longest = max(longest, total)
    w0, w1, w2, w3 = lane_words[0], lane_words[1], lane_words[2], lane_words[3]
    # per lane: state x, next word p and the last one's index a (uint64), word count z,
    # segment g, its end e, table row r, look-up row u, next output k
    n0, n1, n2, n3 = np.uint64(w0.size), np.uint64(w1.size), np.uint64(w2.size), np.uint64(w3.size)
    a0, a1 = n0 - np.uint64(1), n1 - np.uint64(1)
    a2, a3 = n2 - np.uint64(1), n3 - np.uint64(1)
    x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
    p0 = p1 = p2 = p3 = np.uint64(2)
    e0, e1, e2, e3 = ends[0], ends[1], ends[2], ends[3]
    k0, k1, k2, k3 = ks[0], ks[1], ks[2], ks[3]
    g0 = g1 = g2 = g3 = -1
    park = q.shape[0] - LANES
    r0, r1, r2, r3 = park, park + 1, park + 2, park + 3
    u0 = u1 = u2 = u3 = LANES
    it = 0  # steps run so far
    while True:
        # segment changes; then every lane runs until the first of them ends its segment
        if k0 == e0:
            x0, g0, e0, r0, u0, k0 = _dec_advance(0, k0, x0, p0, n0, g0, it, counts, q, start,
                                                  lut, out_end, status)
        if k1 == e1:
            x1, g1, e1, r1, u1, k1 = _dec_advance(1, k1, x1, p1, n1, g1, it, counts, q, start,
                                                  lut, out_end, status)
        if k2 == e2:
            x2, g2, e2, r2, u2, k2 = _dec_advance(2, k2, x2, p2, n2, g2, it, counts, q, start,
                                                  lut, out_end, status)
        if k3 == e3:
            x3, g3, e3, r3, u3, k3 = _dec_advance(3, k3, x3, p3, n3, g3, it, counts, q, start,
                                                  lut, out_end, status)
        run = min(min(e0 - k0, e1 - k1), min(e2 - k2, e3 - k3))
        if run > longest:  # every lane parked
            break
        q0, c0, l0, h0, o0 = q[r0], start[r0], lut[u0], hist[r0], out[k0:k0 + run]
        q1, c1, l1, h1, o1 = q[r1], start[r1], lut[u1], hist[r1], out[k1:k1 + run]
        q2, c2, l2, h2, o2 = q[r2], start[r2], lut[u2], hist[r2], out[k2:k2 + run]
        q3, c3, l3, h3, o3 = q[r3], start[r3], lut[u3], hist[r3], out[k3:k3 + run]
        for j in range(run):
            x0, p0 = _dec_step(x0, p0, a0, j, q0, c0, l0, o0, h0, w0)
            x1, p1 = _dec_step(x1, p1, a1, j, q1, c1, l1, o1, h1, w1)
            x2, p2 = _dec_step(x2, p2, a2, j, q2, c2, l2, o2, h2, w2)
            x3, p3 = _dec_step(x3, p3, a3, j, q3, c3, l3, o3, h3, w3)
        k0 += run
        k1 += run
        k2 += run
        k3 += run
        it += run


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


def decode_lanes(chunks: list[tuple[np.ndarray, list[int], list[tuple[np.ndarray, np.ndarray]]]]
                 ) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """decode() of 1..LANES chunks [(words, counts, tables)] in one interleaved kernel call
    (rans_decode_lanes): the same results, about LANES times the symbols per second."""
    n = len(chunks)
    if not 1 <= n <= LANES:
        raise ValueError(f"decode_lanes takes 1..{LANES} chunks, got {n}")
    segs = max(1, max(len(counts) for _, counts, _ in chunks))
    counts_all = np.zeros((n, segs), dtype=np.int64)
    q_all = np.zeros((n * segs + LANES, 256), dtype=np.uint32)  # + the lanes' parking rows
    q_all[-LANES:, 0] = PROB_SCALE
    start_all = np.zeros((n * segs + LANES, 256), dtype=np.uint32)
    words_all, word_at, out_at, longest = [], [0], [0], 0
    for i, (words, counts, tables) in enumerate(chunks):
        w = np.ascontiguousarray(words, dtype=np.uint32)
        words_all.append(w)
        word_at.append(word_at[-1] + w.size)
        counts_all[i, : len(counts)] = counts
        q, start = table_arrays(tables)
        q_all[i * segs : i * segs + q.shape[0]] = q
        start_all[i * segs : i * segs + start.shape[0]] = start
        total = int(sum(counts))
        out_at.append(out_at[-1] + total)
        longest = max(longest, total)
    words_all.append(np.zeros(1, dtype=np.uint32))  # sentinel: the parked lanes' word
    out = np.empty(out_at[-1] + longest, dtype=np.uint8)
    hist = np.zeros((n * segs + LANES, 256), dtype=np.int64)
    status = np.zeros(n, dtype=np.int64)
    rans_decode_lanes(np.concatenate(words_all), np.array(word_at, dtype=np.int64), counts_all,
                      q_all, start_all, out, np.array(out_at, dtype=np.int64), hist, status)
    return [(int(status[i]), out[out_at[i]:out_at[i + 1]],
             hist[i * segs : i * segs + len(chunks[i][1])]) for i in range(n)]


def encode_lanes(chunks: list[tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]]
                 ) -> list[np.ndarray]:
    """encode() of 1..LANES chunks [(symbols, tables)] in one interleaved kernel call
    (rans_encode_lanes): the same words. As for encode(), every symbol must have q > 0 in
    its segment's table (the encoder's own histogram: cachegen's tables)."""
    n = len(chunks)
    if not 1 <= n <= LANES:
        raise ValueError(f"encode_lanes takes 1..{LANES} chunks, got {n}")
    segs = max(1, max(len(symbols) for symbols, _ in chunks))
    counts = np.zeros((n, segs), dtype=np.int64)
    q_all = np.zeros((n * segs + LANES, 256), dtype=np.uint32)  # + the lanes' parking rows
    q_all[-LANES:, 0] = PROB_SCALE
    start_all = np.zeros((n * segs + LANES, 256), dtype=np.uint32)
    flat, sym_at, out_at = [], [0], [0]
    for i, (symbols, tables) in enumerate(chunks):
        for j, seg in enumerate(symbols):
            seg = np.asarray(seg, dtype=np.uint8)
            flat.append(seg)
            counts[i, j] = seg.size
        sym_at.append(sym_at[-1] + int(counts[i].sum()))
        out_at.append(out_at[-1] + (sym_at[-1] - sym_at[-2]) // 2 + 4)
        if tables:
            q, start = table_arrays(tables)
            q_all[i * segs : i * segs + q.shape[0]] = q
            start_all[i * segs : i * segs + start.shape[0]] = start
    longest = max(sym_at[i + 1] - sym_at[i] for i in range(n))
    flat.append(np.zeros(longest, dtype=np.uint8))  # the parked lanes' symbols
    out = np.empty(out_at[-1] + 1, dtype=np.uint32)  # + the parked lanes' scratch word
    n_words = np.zeros(n, dtype=np.int64)
    rans_encode_lanes(np.concatenate(flat), np.array(sym_at, dtype=np.int64), counts, q_all,
                      start_all, out, np.array(out_at, dtype=np.int64), n_words)
    return [out[out_at[i] : out_at[i] + n_words[i]].copy() for i in range(n)]
