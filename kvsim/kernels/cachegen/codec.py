"""`cachegen`: the CacheGen baseline (Liu et al., SIGCOMM 2024), as the Lynx paper ran it.

Lossy part (token-wise quantization with delta encoding):
- Tokens of a page are split into groups of `group_tokens` consecutive tokens. The first
  token of a group is its *anchor*; it is quantized at `anchor_bits`. Every other token is
  encoded as its difference from the *reconstructed* anchor (so errors do not compound),
  quantized at the bits of its layer band. group_tokens = 1 turns delta encoding off.
- Quantization is token-wise and symmetric: one fp16 scale per (K/V, kv head, token) row of
  head_dim elements, scale = max|row| / qmax rounded *up* to fp16, qmax = 2^(bits-1) - 1,
  codes round(x / scale) in [-qmax, qmax].
- Layers are split into bands by depth (`band_edges`, fractions of the layer count); earlier
  bands get more bits (CacheGen's layer-wise sensitivity; Lynx evaluated a mixed INT8/INT4
  setting, which is the default here: k_bits = v_bits = (8, 4)).

Lossless part: the codes are entropy coded with kvsim's rANS coder (kvsim.kernels.cachegen.rans, one
coder state per chunk) under static models whose frequency tables are measured per chunk
and sent with it.

Monolithic: one stream ("full"); chunk = layer x page; every chunk decodes on its own.

Chunk payload (little-endian), n = tokens in the page, H = kv heads:
  scales   fp16 [2 (K, V), H, n]        anchor tokens: anchor scale, others: delta scale
  4 tables, one per segment in the order K-anchor, K-delta, V-anchor, V-delta:
           u16 lo | u16 nsym | nsym x u16 freq   (symbol s = code + qmax; lo = smallest used,
                                                  lo + nsym - 1 = largest used; zero freq =
                                                  unused; nsym = 0: empty segment; nsym = 1:
                                                  every symbol is lo, nothing coded)
  words    u32 [...] rANS output for the segments with nsym > 1, in segment order (none
           when no segment is coded);
           segment symbols are codes [H, tokens of that kind in the page, head_dim] in C order.

Sizes are data dependent, so `exact_sizes = False`: payload_bytes(shape) is an estimate that
counts scales and table headers exactly and the coded bits with bits-per-symbol measured by
coding KV (kvsim.kernels.cachegen.size): `calibrate` measures them on a sample of the KV at
hand and states the held-out error; without it, data/cachegen_ratio.json (measured on a
SmolLM2 capture; its error on other KV is unknown). Re-measure that file on a capture:
    python -m kvsim.bench.cachegen_ratio --capture NAME --out data/cachegen_ratio.json
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsim.core.layout import KVShape, check_finite
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.cachegen.size import (
    RATIO_FILE,
    CacheGenSizeModel,
    SegmentTally,
    SizeModelError,
    chunk_bytes_estimate,
)
from kvsim.kernels.codec import Codec, CodecError, cast_finite, finite_bits, register
from kvsim.kernels.encoded import Chunk, Encoded

if TYPE_CHECKING:
    import torch

    from kvsim.kernels import torch_threads
    from kvsim.kernels.cachegen import cpu as cachegen_cpu
    from kvsim.kernels.cachegen import rans
else:
    torch = lazy_module("torch")
    cachegen_cpu = lazy_module("kvsim.kernels.cachegen.cpu")
    rans = lazy_module("kvsim.kernels.cachegen.rans")
    torch_threads = lazy_module("kvsim.kernels.torch_threads")

SEGMENTS = (("K", "anchor"), ("K", "delta"), ("V", "anchor"), ("V", "delta"))
MIN_BITS, MAX_BITS = 2, 8
MAX_FREQ = 65535  # frequencies are stored as u16
_SYMBOL_BATCH_BYTES = 256 << 20  # the encoder's quantized layers held at once (uint8 symbols)


@dataclass(frozen=True)
class CacheGenParams:
    page_tokens: int = 256
    group_tokens: int = 10  # tokens per delta group (first = anchor); 1 = no delta encoding
    anchor_bits: int = 8  # bits of anchor tokens (all layers)
    band_edges: tuple[float, ...] = (0.5,)  # depth fractions where the next band starts
    k_bits: tuple[int, ...] = (8, 4)  # bits of key deltas per band (len(band_edges) + 1)
    v_bits: tuple[int, ...] = (8, 4)  # bits of value deltas per band

    def __post_init__(self) -> None:
        for name in ("band_edges", "k_bits", "v_bits"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.page_tokens < 1 or self.group_tokens < 1:
            raise ValueError("page_tokens and group_tokens must be >= 1")
        edges = self.band_edges
        if any(not 0.0 < e < 1.0 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"band_edges must be strictly increasing fractions in (0, 1), "
                             f"got {list(edges)}")
        bands = len(edges) + 1
        if len(self.k_bits) != bands or len(self.v_bits) != bands:
            raise ValueError(f"k_bits and v_bits need {bands} entries (one per band), got "
                             f"{list(self.k_bits)} and {list(self.v_bits)}")
        for bits in (self.anchor_bits, *self.k_bits, *self.v_bits):
            if not (isinstance(bits, int) and MIN_BITS <= bits <= MAX_BITS):
                raise ValueError(f"bits must be ints in {MIN_BITS}..{MAX_BITS}, got {bits!r}")


# ---- quantizer (shared by encoder, decoder and the size model) ------------------------------
def _fp16_scale_up(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales >= 0 -> the smallest fp16 values >= them (so |x / scale| <= qmax holds)."""
    s16 = scale.to(torch.float16)
    bits = s16.view(torch.int16)
    # the bit pattern of a positive finite fp16 + 1 is the next larger fp16 value
    bits = bits + ((s16.to(torch.float32) < scale) & ~torch.isinf(s16)).to(torch.int16)
    up = bits.view(torch.float16)
    if torch.isinf(up).any():  # checked after the step up: 65504 < scale < 65520 lands here
        raise CodecError("cachegen: |values| too large for fp16 token scales "
                         f"(max scale {float(scale.max()):.3g} > 65504)")
    return up


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] fp32 -> (codes int32 [..., head_dim] in [-qmax, qmax],
    fp16 scales [...])."""
    qmax = 2 ** (bits - 1) - 1
    scale16 = _fp16_scale_up(x.abs().amax(dim=-1) / qmax)
    scale = scale16.to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    codes = torch.round(x / safe).clamp_(-qmax, qmax).to(torch.int32)
    return codes, scale16


def dequantize_rows(codes: torch.Tensor, scale16: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_rows: [..., head_dim] fp32 (the decoder runs exactly this)."""
    return codes.to(torch.float32) * scale16.to(torch.float32)[..., None]


@functools.lru_cache(maxsize=16)  # asked per layer; callers never modify the tensors
def _token_roles(tokens: int, page_tokens: int, group_tokens: int) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """(is_anchor bool [tokens], anchor_rank int64 [tokens]: index among anchors of the anchor
    each token is coded against). Groups never cross a page boundary."""
    t = torch.arange(tokens)
    page_start = (t // page_tokens) * page_tokens
    anchor_pos = page_start + ((t - page_start) // group_tokens) * group_tokens
    is_anchor = anchor_pos == t
    rank = torch.cumsum(is_anchor.to(torch.int64), 0) - 1  # [tokens]
    return is_anchor, rank[anchor_pos]


@dataclass
class _LayerCodes:
    """One layer, quantized. Na = anchor tokens, Nd = delta tokens of the layer."""

    anchor_codes: torch.Tensor  # int32 [2, H, Na, D]
    anchor_scales: torch.Tensor  # fp16 [2, H, Na]
    delta_codes: torch.Tensor  # int32 [2, H, Nd, D]
    delta_scales: torch.Tensor  # fp16 [2, H, Nd]


def _reconstruct(codes: _LayerCodes, is_anchor: torch.Tensor, rank: torch.Tensor,
                 device: torch.device) -> torch.Tensor:
    """fp32 [2, H, T, D] from the codes: anchors, then anchors + deltas."""
    anchors = dequantize_rows(codes.anchor_codes.to(device), codes.anchor_scales.to(device))
    two, heads, _, dim = anchors.shape
    out = torch.empty(two, heads, is_anchor.numel(), dim, dtype=torch.float32, device=device)
    is_anchor = is_anchor.to(device)
    out[:, :, is_anchor] = anchors
    delta_rank = rank.to(device)[~is_anchor]
    out[:, :, ~is_anchor] = anchors[:, :, delta_rank] + dequantize_rows(
        codes.delta_codes.to(device), codes.delta_scales.to(device))
    return out


# ---- entropy coding of one segment ------------------------------------------------------------
def _frequency_table(symbols: np.ndarray) -> tuple[int, np.ndarray]:
    """symbols: uint8 -> (lo, u16 frequencies of symbols lo..hi); every used symbol > 0."""
    counts = np.zeros(256, dtype=np.int64)
    rans.histogram(np.ascontiguousarray(symbols, dtype=np.uint8), counts)
    return _table_of_counts(counts)


def _table_of_counts(counts: np.ndarray) -> tuple[int, np.ndarray]:
    """A histogram (int64 [256], not all zero) -> (lo, u16 frequencies of lo..hi), counts
    scaled to fit u16 when the largest exceeds 65535."""
    used = np.nonzero(counts)[0]
    lo, hi = int(used[0]), int(used[-1])
    freq = counts[lo : hi + 1].astype(np.float64)
    if freq.max() > MAX_FREQ:
        # ceil keeps every used symbol > 0; min guards 65535.000001 -> 65536 (u16 overflow)
        freq = np.where(freq > 0, np.minimum(np.ceil(freq * (MAX_FREQ / freq.max())), MAX_FREQ),
                        0.0)
    return lo, freq.astype(np.uint16)


def _segment_table(symbols: np.ndarray) -> tuple[bytes, np.ndarray | None, tuple | None]:
    """One segment (int32 symbols >= 0) -> (its table bytes, its symbols relative to lo as
    uint8 and its quantized rANS table when it is coded (nsym > 1), else None, None)."""
    if symbols.size == 0:
        return np.array([0, 0], dtype="<u2").tobytes(), None, None
    lo, freq = _frequency_table(symbols)
    table = np.concatenate([np.array([lo, freq.size], dtype="<u2"), freq.astype("<u2")])
    if freq.size <= 1:
        return table.tobytes(), None, None
    return table.tobytes(), (symbols - lo).astype(np.uint8), rans.quantize(freq)


def _code_chunk(segs: list[np.ndarray]) -> tuple[list[bytes], np.ndarray]:
    """A chunk's 4 segments -> (4 table byte strings, the rANS words of its coded ones)."""
    return _code_chunks([segs])[0]


def _code_chunks(chunks: list[list[np.ndarray]]) -> list[tuple[list[bytes], np.ndarray]]:
    """_code_chunk of 1..rans.LANES chunks, their words coded together (rans.encode_lanes:
    the same words)."""
    tables, todo = [], []
    for segs in chunks:
        chunk_tables, coded, quantized = [], [], []
        for symbols in segs:
            table, rel, q = _segment_table(symbols)
            chunk_tables.append(table)
            if rel is not None:
                coded.append(rel)
                quantized.append(q)
        tables.append(chunk_tables)
        todo.append((coded, quantized))
    words = rans.encode_lanes(todo)
    return list(zip(tables, words, strict=True))


def _coded_bits(symbols: np.ndarray, freq: np.ndarray, lo: int) -> float:
    """Bits the rANS coder spends on a segment (its quantized probabilities' information;
    the chunk's 2-word state flush is counted by the size model)."""
    if freq.size <= 1:
        return 0.0
    q, _ = rans.quantize(freq)
    counts = np.bincount(symbols - lo, minlength=freq.size)
    used = counts > 0
    return float(np.sum(counts[used] * (rans.PROB_BITS - np.log2(q[used].astype(np.float64)))))


def _table_size_bytes(nsym: int) -> int:
    return 4 + 2 * nsym


@register
class CacheGenCodec(Codec):
    name = "cachegen"
    Params = CacheGenParams
    exact_sizes = False
    layer_independent = False  # its bits per layer depend on the layer's depth band

    def stream_names(self) -> list[str]:
        return ["full"]

    def page_tokens(self, shape: KVShape) -> int:
        return self.params.page_tokens

    def band(self, layer: int, layers: int) -> int:
        """Band index of a layer: how many band edges lie at or below its depth fraction."""
        return sum(layer / layers >= e for e in self.params.band_edges)

    def layer_bits(self, layer: int, layers: int) -> tuple[int, int]:
        """(key delta bits, value delta bits) of one layer."""
        b = self.band(layer, layers)
        return self.params.k_bits[b], self.params.v_bits[b]

    # ---- size model -------------------------------------------------------------------------
    @property
    def size_model(self) -> CacheGenSizeModel:
        """The rates payload_bytes uses: set by `calibrate`, else the measured file
        (data/cachegen_ratio.json, loaded on first use)."""
        if getattr(self, "_size_model", None) is None:
            try:
                self._size_model = CacheGenSizeModel.load(RATIO_FILE)
            except SizeModelError as exc:
                raise CodecError(str(exc)) from exc
        return self._size_model

    def use_size_model(self, model: CacheGenSizeModel) -> CacheGenCodec:
        """Estimate sizes with `model` from now on (returns self)."""
        self._size_model = model
        return self

    def size_note(self) -> str:
        return self.size_model.describe()

    def payload_bytes(self, shape: KVShape) -> np.ndarray:
        """Estimated payload bytes [1, layers, pages]: scales and table headers exact; table
        lengths and coded bits from `size_model` (see kvsim.kernels.cachegen.size)."""
        model = self.size_model
        p = self.params
        pages = self.num_pages(shape)
        n = np.full(pages, p.page_tokens, dtype=np.int64)  # tokens per page
        n[-1] = shape.tokens - p.page_tokens * (pages - 1)
        n_anchor = -(-n // p.group_tokens)
        out = np.empty((1, shape.layers, pages), dtype=np.int64)
        for layer in range(shape.layers):
            bits = (p.anchor_bits, *self.layer_bits(layer, shape.layers))
            try:
                out[0, layer] = chunk_bytes_estimate(model, n, n_anchor, shape.kv_heads,
                                                     shape.head_dim, bits)
            except SizeModelError as exc:
                raise CodecError(str(exc)) from exc
        return out

    def calibrate(self, layer_kv: Callable[[int], torch.Tensor], shape: KVShape,
                  source: dict[str, Any], max_chunks: int = 16) -> CacheGenSizeModel:
        """Measure the size model on the KV being simulated and use it from now on.

        layer_kv(l) -> layer l's KV [2, kv_heads, tokens, head_dim] of `shape` (only the
        sampled layers are asked for). Encodes up to `max_chunks` (layer, page) chunks spread
        evenly over layers and pages, each for real (its coded size) and segment by segment
        (the rates). `expected_error` is the held-out error: the chunks split in two
        alternating halves, each half's total size estimated from the other half's rates
        (worst of the two, relative to the real bytes)."""
        if max_chunks < 2:
            raise ValueError(f"max_chunks must be >= 2 (one to fit, one to check), got "
                             f"{max_chunks}")
        self.check_shape(shape)
        p = self.params
        pages = self._page_ranges(shape)
        is_anchor = _token_roles(shape.tokens, p.page_tokens, p.group_tokens)[0].numpy()
        picks = _spread_chunks(shape.layers, len(pages), max_chunks)
        by_layer: dict[int, list[int]] = {}
        for layer, page in picks:
            by_layer.setdefault(layer, []).append(page)
        halves = ({}, {})  # two tallies, chunks alternating between them
        real = [0, 0]  # real payload bytes of each half
        chunk_meta: list[list[tuple[int, int, tuple[int, int, int]]]] = [[], []]
        i = 0
        for layer, layer_pages in sorted(by_layer.items()):
            x = layer_kv(layer)
            if tuple(x.shape) != tuple(shape.dims[1:]):
                raise ValueError(f"layer_kv({layer}) has shape {tuple(x.shape)}, expected "
                                 f"{tuple(shape.dims[1:])}")
            check_finite(x)
            sym, _ = self.layer_symbols(x, layer, shape.layers)
            bits = (p.anchor_bits, *self.layer_bits(layer, shape.layers))
            for page in layer_pages:
                t0, t1, a_range, _ = pages[page]
                segs = _chunk_segments(sym, is_anchor, t0, t1)
                half = i % 2
                real[half] += _coded_chunk_bytes(segs, shape.kv_heads, t1 - t0)
                _tally_segments(halves[half], segs, bits)
                chunk_meta[half].append((t1 - t0, a_range[1] - a_range[0], bits))
                i += 1
        errors = []
        for fit, check in ((0, 1), (1, 0)):
            fitted = CacheGenSizeModel.from_tallies(halves[fit], source, None, 0)
            try:
                estimate = sum(int(chunk_bytes_estimate(
                    fitted, np.array([n]), np.array([na]), shape.kv_heads, shape.head_dim,
                    bits)[0]) for n, na, bits in chunk_meta[check])
            except SizeModelError:
                continue  # a segment kind only one half saw (a single band per half)
            errors.append(abs(estimate - real[check]) / max(real[check], 1))
        merged: dict[tuple[str, str, int], SegmentTally] = {}
        for tallies in halves:
            for key, t in tallies.items():
                merged.setdefault(key, SegmentTally()).merge(t)
        model = CacheGenSizeModel.from_tallies(merged, source, max(errors) if errors else None,
                                               len(picks))
        self.use_size_model(model)
        return model

    # ---- encode -------------------------------------------------------------------------------
    def quantize_layer(self, x: torch.Tensor, layer: int, layers: int) -> _LayerCodes:
        """x: [2, H, T, D] one layer -> its codes and scales (fp32 arithmetic)."""
        p = self.params
        x = x.to(torch.float32)
        is_anchor, rank = _token_roles(x.shape[2], p.page_tokens, p.group_tokens)
        is_anchor, rank = is_anchor.to(x.device), rank.to(x.device)
        a_codes, a_scales = quantize_rows(x[:, :, is_anchor], p.anchor_bits)
        anchors = dequantize_rows(a_codes, a_scales)  # [2, H, Na, D] reconstructed anchors
        delta = x[:, :, ~is_anchor] - anchors[:, :, rank[~is_anchor]]  # [2, H, Nd, D]
        kb, vb = self.layer_bits(layer, layers)
        k_codes, k_scales = quantize_rows(delta[0], kb)
        v_codes, v_scales = quantize_rows(delta[1], vb)
        return _LayerCodes(a_codes, a_scales, torch.stack([k_codes, v_codes]),
                           torch.stack([k_scales, v_scales]))

    def reference(self, kv: torch.Tensor) -> torch.Tensor:
        """What decode(encode(kv)) must return (fp32, [layers, 2, H, T, D]): the quantized
        values, computed without entropy coding. Decoding must match it bit for bit."""
        shape = KVShape.of(kv)
        is_anchor, rank = _token_roles(shape.tokens, self.params.page_tokens,
                                       self.params.group_tokens)
        return torch.stack([
            _reconstruct(self.quantize_layer(kv[layer], layer, shape.layers), is_anchor, rank,
                         kv.device)
            for layer in range(shape.layers)])

    def qmaxes(self, layer: int, layers: int) -> tuple[int, int, int]:
        """qmax of (anchor, K delta, V delta) codes of one layer: symbol = code + qmax."""
        kb, vb = self.layer_bits(layer, layers)
        return tuple(2 ** (b - 1) - 1 for b in (self.params.anchor_bits, kb, vb))

    def layer_symbols(self, x: torch.Tensor, layer: int, layers: int
                      ) -> tuple[np.ndarray, np.ndarray]:
        """x: [2, H, T, D] one layer -> (symbols uint8 [2, H, T, D] in token order, fp16
        scale bits uint16 [2, H, T]): the numba kernel on CPU tensors, the torch reference
        (quantize_layer) elsewhere; the same values (tests/test_cachegen.py)."""
        p = self.params
        qa, qk, qv = self.qmaxes(layer, layers)
        is_anchor = _token_roles(x.shape[2], p.page_tokens, p.group_tokens)[0]
        if x.device.type != "cpu":
            return _symbols_from_codes(self.quantize_layer(x, layer, layers),
                                       is_anchor.numpy(), (qa, qk, qv))
        sym = np.empty(tuple(x.shape), dtype=np.uint8)
        scales = np.empty(tuple(x.shape[:3]), dtype=np.uint16)
        overflow = np.zeros(2 * x.shape[1], dtype=np.int64)
        with torch_threads.kept():  # numba's kernel would leave torch on every core
            if x.dtype == torch.bfloat16:  # read as its bits (no fp32 copy of the layer)
                xb = x.contiguous().view(torch.int16).numpy().view(np.uint16)
                cachegen_cpu.quantize_layer_kernel(np.zeros((1, 1, 1, 1), np.float32),
                                                   is_anchor.numpy(), qa, qk, qv, sym, scales,
                                                   overflow, xb)
            else:
                cachegen_cpu.quantize_layer_kernel(x.to(torch.float32).contiguous().numpy(),
                                                   is_anchor.numpy(), qa, qk, qv, sym,
                                                   scales, overflow)
        if overflow.any():
            raise CodecError("cachegen: |values| too large for fp16 token scales "
                             f"(max |x| {float(x.abs().max()):.3g} / qmax > 65504)")
        return sym, scales

    def _page_ranges(self, shape: KVShape) -> list[tuple[int, int, tuple[int, int],
                                                         tuple[int, int]]]:
        """Per page: (t0, t1, anchor index range, delta index range) within the layer."""
        is_anchor, _ = _token_roles(shape.tokens, self.params.page_tokens,
                                    self.params.group_tokens)
        before = torch.cat([torch.zeros(1, dtype=torch.int64),
                            torch.cumsum(is_anchor.to(torch.int64), 0)]).tolist()
        pt, out = self.params.page_tokens, []
        for page in range(self.num_pages(shape)):
            t0, t1 = page * pt, min((page + 1) * pt, shape.tokens)
            a0, a1 = before[t0], before[t1]
            out.append((t0, t1, (a0, a1), (t0 - a0, t1 - a1)))
        return out

    def _encode(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        p = self.params
        is_anchor = _token_roles(shape.tokens, p.page_tokens, p.group_tokens)[0].numpy()
        pages = self._page_ranges(shape)
        lanes = rans.LANES
        # a batch of layers' symbols first, then their coding: the quantizer's parallel
        # kernel leaves its worker threads spinning for a while after each call, which
        # would take the cores from the coder threads if the two alternated layer by layer;
        # batches of at most _SYMBOL_BATCH_BYTES of symbols bound the memory this holds
        layer_bytes = 2 * shape.kv_heads * shape.tokens * shape.head_dim
        batch = max(1, min(shape.layers, _SYMBOL_BATCH_BYTES // max(1, layer_bytes)))
        chunks = []
        for first_layer in range(0, shape.layers, batch):
            layers = range(first_layer, min(shape.layers, first_layer + batch))
            layer_syms = {layer: self.layer_symbols(kv[layer], layer, shape.layers)
                          for layer in layers}

            def code_pages(task: tuple[int, int], layer_syms=layer_syms) -> list[np.ndarray]:
                layer, first = task
                sym, scales = layer_syms[layer]
                ranges = [pages[page][:2] for page in range(first, min(first + lanes,
                                                                       len(pages)))]
                coded = _code_chunks([_chunk_segments(sym, is_anchor, t0, t1)
                                      for t0, t1 in ranges])
                out = []
                for (t0, t1), (tables, words) in zip(ranges, coded, strict=True):
                    page_scales = np.ascontiguousarray(scales[:, :, t0:t1]).astype("<u2")
                    out.append(np.frombuffer(b"".join([page_scales.tobytes(), *tables,
                                                       words.astype("<u4").tobytes()]),
                                             dtype=np.uint8))
                return out

            # the coder kernels release the GIL: pages are coded in parallel, rans.LANES
            # per task (their coders interleaved: rans.encode_lanes), in (layer, page) order
            tasks = [(layer, first) for layer in layers for first in range(0, len(pages), lanes)]
            payloads = [c for coded in _pool().map(code_pages, tasks) for c in coded]
            chunks += [Chunk(0, layer, page, payloads[i * len(pages) + page])
                       for i, layer in enumerate(layers) for page in range(len(pages))]
        return [chunks]

    # ---- decode -------------------------------------------------------------------------------
    def _decode_symbols(self, enc: Encoded,
                        after: Callable[[np.ndarray, np.ndarray, np.ndarray, _ChunkIn], None]
                        | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every chunk -> (symbols uint8 [L, 2, H, T, D] in token order, fp16 scale bits
        uint16 [L, 2, H, T], qmaxes int64 [L, 3]); chunks are decoded rans.LANES at a time on
        the pool's threads (the coder and scatter kernels release the GIL), each followed by
        after(sym, scales, qmaxes, chunk) on the same thread; the first failing chunk (in
        order) raises."""
        shape, p = enc.shape, self.params
        heads, dim = shape.kv_heads, shape.head_dim
        anchor_np = _token_roles(shape.tokens, p.page_tokens, p.group_tokens)[0].numpy()
        payloads = enc.payloads(0)
        sym = np.empty((shape.layers, 2, heads, shape.tokens, dim), dtype=np.uint8)
        scales = np.empty((shape.layers, 2, heads, shape.tokens), dtype=np.uint16)
        qmaxes = np.array([self.qmaxes(layer, shape.layers) for layer in range(shape.layers)],
                          dtype=np.int64).reshape(shape.layers, 3)
        pages = self._page_ranges(shape)

        chunks = [_ChunkIn(payloads[(layer, page)], layer, page,
                           self.qmaxes(layer, shape.layers), (t0, t1), anchor_np[t0:t1])
                  for layer in range(shape.layers) for page, (t0, t1, _, _) in enumerate(pages)]
        # rans.LANES chunks per task (their coders interleaved), tasks in order
        lanes = rans.LANES
        done = None if after is None else (lambda c: after(sym, scales, qmaxes, c))
        list(_pool().map(lambda i: self._decode_chunks(chunks[i:i + lanes], sym, scales, done),
                         range(0, len(chunks), lanes)))
        return sym, scales, qmaxes

    def _decode(self, enc: Encoded, streams: int, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self._decode_cpu(enc, torch.float32)
        shape, p = enc.shape, self.params
        is_anchor, rank = _token_roles(shape.tokens, p.page_tokens, p.group_tokens)
        sym, scales, qmaxes = self._decode_symbols(enc)
        out = torch.empty(shape.dims, dtype=torch.float32, device=device)
        for layer in range(shape.layers):
            codes = _codes_from_symbols(sym[layer], scales[layer], is_anchor.numpy(),
                                        self.qmaxes(layer, shape.layers))
            out[layer] = _reconstruct(codes, is_anchor, rank, device)
        return out

    def _decode_to(self, enc: Encoded, streams: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
        if device.type == "cpu":  # the kernel writes `dtype` directly
            return self._decode_cpu(enc, dtype)
        return super()._decode_to(enc, streams, device, dtype)

    def _decode_cpu(self, enc: Encoded, dtype: torch.dtype) -> torch.Tensor:
        """The cache in `dtype` (fp32, or bf16 / fp16 rounded from the fp32 reconstruction as
        codec.cast_finite): each page reconstructed (cachegen_cpu.reconstruct_chunk) on the
        decoder thread that has just put its symbols in place."""
        shape, p = enc.shape, self.params
        anchor_np = _token_roles(shape.tokens, p.page_tokens, p.group_tokens)[0].numpy()
        mode = {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)
        n = int(np.prod(shape.dims))
        out_f = np.empty(n if mode == 0 else 1, np.float32)
        out_b = np.empty(n if mode else 1, np.uint16)

        def reconstruct(sym: np.ndarray, scales: np.ndarray, qmaxes: np.ndarray,
                        chunk: _ChunkIn) -> None:
            cachegen_cpu.reconstruct_chunk(sym, scales, anchor_np, qmaxes, mode, out_f, out_b,
                                           chunk.layer, *chunk.t_range)

        self._decode_symbols(enc, reconstruct)
        if mode == 0:
            out = torch.from_numpy(out_f).view(shape.dims)
            return out if dtype == torch.float32 else cast_finite(out, dtype)
        return torch.from_numpy(out_b.view(np.int16)).view(shape.dims).view(
            torch.bfloat16 if mode == 1 else torch.float16)

    def _decode_chunks(self, chunks: list[_ChunkIn], sym: np.ndarray, scales: np.ndarray,
                       after: Callable[[_ChunkIn], None] | None = None) -> None:
        """1..rans.LANES chunks' payloads into the cache's symbols and scales (token order, in
        place), their coded words decoded together (rans.decode_lanes). The payloads are
        untrusted: scales must be finite; each table must fit its segment (symbols within
        0..2 qmax, empty iff the segment is); the rANS decoder must use up every coded word
        and end in its initial state (kvsim.kernels.cachegen.rans), and each decoded segment must
        reproduce its table exactly (the table is the encoder's histogram of the segment),
        which catches truncated, padded and corrupted words. Checked in order: the first
        chunk's error is raised first."""
        parsed: list[_ChunkParsed] = []
        error = None
        for c in chunks:
            try:
                parsed.append(self._parse_chunk(c, sym.shape[2], sym.shape[4], scales[c.layer]))
            except CodecError as exc:  # raised after the chunks before it are checked
                error = exc
                break
        args = [(p.words, [p.counts[i] for i in p.coded],
                 [rans.quantize(p.tables[i][1]) for i in p.coded]) for p in parsed]
        results = rans.decode_lanes(args) if args else []
        for c, p, (status, flat, hist) in zip(chunks[:len(parsed)], parsed, results, strict=True):
            self._finish_chunk(c, p, status, flat, hist, sym[c.layer])
            if after is not None:
                after(c)
        if error is not None:
            raise error

    def _parse_chunk(self, chunk: _ChunkIn, heads: int, dim: int, scales: np.ndarray
                     ) -> _ChunkParsed:
        """A chunk's scales (into the layer's `scales` [2, H, T]) and checked tables."""
        layer, page, page_anchor = chunk.layer, chunk.page, chunk.page_anchor
        payload, qmaxes, t_range = chunk.payload, chunk.qmaxes, chunk.t_range
        where = f"cachegen: chunk (stream 0, layer {layer}, page {page})"
        buf = np.ascontiguousarray(payload, dtype=np.uint8)
        t0, t1 = t_range
        n = t1 - t0
        na = int(page_anchor.sum())
        off = 2 * 2 * heads * n
        if buf.size < off:
            raise CodecError(f"{where}: payload of {buf.size} bytes is shorter than its scales")
        if not finite_bits(buf[:off], "f16"):
            raise CodecError(f"{where}: token scales hold NaN or Inf")
        qa, qk, qv = qmaxes
        # segments in payload order: (K/V, token mask of the page, rows, qmax)
        targets = ((0, page_anchor, na, qa), (0, ~page_anchor, n - na, qk),
                   (1, page_anchor, na, qa), (1, ~page_anchor, n - na, qv))
        tables = []
        for (tensor, kind), (_, _, rows, qmax) in zip(SEGMENTS, targets, strict=True):
            what = f"{where}: {tensor}-{kind} frequency table"
            if buf.size < off + 4:
                raise CodecError(f"{what} is truncated")
            lo, nsym = (int(v) for v in buf[off : off + 4].view("<u2"))
            if buf.size < off + 4 + 2 * nsym:
                raise CodecError(f"{what} is truncated ({nsym} symbols)")
            freq = buf[off + 4 : off + 4 + 2 * nsym].view("<u2").astype(np.uint16)
            # the encoder writes lo..hi with both ends used (inner zeros are unused symbols)
            if freq.size != nsym or (nsym and (freq[0] == 0 or freq[-1] == 0)):
                raise CodecError(f"{what} is malformed")
            if (nsym == 0) != (heads * rows * dim == 0):
                raise CodecError(f"{what} has {nsym} symbols for a segment of "
                                 f"{heads * rows * dim} codes")
            if nsym and lo + nsym - 1 > 2 * qmax:
                raise CodecError(f"{what} names symbols {lo}..{lo + nsym - 1}, beyond the "
                                 f"code range 0..{2 * qmax}")
            tables.append((lo, freq))
            off += _table_size_bytes(nsym)
        if (buf.size - off) % 4:
            raise CodecError(f"{where}: coded data is not a whole number of 32-bit words")
        words = buf[off:].view("<u4").astype(np.uint32)
        if words.size and all(freq.size <= 1 for _, freq in tables):
            raise CodecError(f"{where}: {words.size} coded words but no coded segment")
        scales[:, :, t0:t1] = buf[: 2 * 2 * heads * n].view("<u2").reshape(2, heads, n)
        counts = [heads * rows * dim for (_, _, rows, _) in targets]
        coded = [i for i, (_, freq) in enumerate(tables) if counts[i] and freq.size > 1]
        return _ChunkParsed(where, words, counts, coded, tables)

    @staticmethod
    def _finish_chunk(chunk: _ChunkIn, parsed: _ChunkParsed, status: int, flat: np.ndarray,
                      hist: np.ndarray, sym: np.ndarray) -> None:
        """A chunk's decoded symbols, checked, into the layer's `sym` [2, H, T, D]."""
        where, counts, coded, tables = parsed.where, parsed.counts, parsed.coded, parsed.tables
        if status != rans.OK:
            raise CodecError(f"{where}: {rans.STATUS_TEXT[status]}")
        for j, i in enumerate(coded):
            # the table is the encoder's histogram of the segment: the decoded symbols must
            # reproduce it exactly (catches corrupt words the coder's checks miss)
            (tensor, kind), (lo, freq) = SEGMENTS[i], tables[i]
            seg_hist = np.zeros(256, dtype=np.int64)
            seg_hist[lo:] = hist[j, : 256 - lo]
            got_lo, got_freq = _table_of_counts(seg_hist)
            if got_lo != lo or not np.array_equal(got_freq, freq):
                raise CodecError(f"{where}: {tensor}-{kind} codes do not match their "
                                 "frequency table (corrupt coded words)")
        cachegen_cpu.scatter_chunk(flat, np.asarray(counts, dtype=np.int64),
                                   np.array([lo for lo, _ in tables], dtype=np.int64),
                                   np.array([i in coded for i in range(4)], dtype=np.int64),
                                   chunk.page_anchor, chunk.t_range[0], sym)


@dataclass
class _ChunkIn:
    """One chunk to decode: its payload and where its tokens go."""

    payload: np.ndarray
    layer: int
    page: int
    qmaxes: tuple[int, int, int]
    t_range: tuple[int, int]
    page_anchor: np.ndarray  # bool [tokens of the page]: anchor tokens


@dataclass
class _ChunkParsed:
    """A chunk's checked tables and coded words (see CacheGenCodec._decode_chunks)."""

    where: str
    words: np.ndarray  # uint32
    counts: list[int]  # codes per segment
    coded: list[int]  # segments with coded words (nsym > 1)
    tables: list[tuple[int, np.ndarray]]  # (lo, u16 frequencies) per segment


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Threads for the GIL-free coder kernels (one per core)."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                              thread_name_prefix="kvsim-cachegen")


# ---- token-order symbols <-> the reference's anchor / delta codes -----------------------------
def _chunk_segments(sym: np.ndarray, is_anchor: np.ndarray, t0: int, t1: int
                    ) -> list[np.ndarray]:
    """The 4 segments of the chunk of tokens t0..t1 (K-anchor, K-delta, V-anchor, V-delta):
    uint8 symbols, each flattened from [H, tokens of that kind, D] in C order."""
    mask = is_anchor[t0:t1]
    segs = []
    for t in (0, 1):
        page = sym[t, :, t0:t1]
        segs += [np.ascontiguousarray(page[:, mask]).reshape(-1),
                 np.ascontiguousarray(page[:, ~mask]).reshape(-1)]
    return segs


def _symbols_from_codes(codes: _LayerCodes, is_anchor: np.ndarray,
                        qmaxes: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The reference's codes -> (symbols uint8 [2, H, T, D], scale bits uint16 [2, H, T])."""
    qa, qk, qv = qmaxes
    a_codes, d_codes = codes.anchor_codes.cpu().numpy(), codes.delta_codes.cpu().numpy()
    two, heads, _, dim = a_codes.shape
    tokens = is_anchor.size
    sym = np.empty((two, heads, tokens, dim), dtype=np.uint8)
    scales = np.empty((two, heads, tokens), dtype=np.uint16)
    sym[:, :, is_anchor] = a_codes + qa
    sym[0][:, ~is_anchor] = d_codes[0] + qk
    sym[1][:, ~is_anchor] = d_codes[1] + qv
    scales[:, :, is_anchor] = codes.anchor_scales.cpu().view(torch.int16).numpy().view(np.uint16)
    scales[:, :, ~is_anchor] = codes.delta_scales.cpu().view(torch.int16).numpy().view(
        np.uint16)
    return sym, scales


def _codes_from_symbols(sym: np.ndarray, scales: np.ndarray, is_anchor: np.ndarray,
                        qmaxes: tuple[int, int, int]) -> _LayerCodes:
    """Inverse of _symbols_from_codes (for the torch reconstruction off the CPU)."""
    qa, qk, qv = qmaxes
    s16 = torch.from_numpy(scales.view(np.int16).copy()).view(torch.float16)
    delta = np.stack([sym[0][:, ~is_anchor].astype(np.int32) - qk,
                      sym[1][:, ~is_anchor].astype(np.int32) - qv])
    return _LayerCodes(torch.from_numpy(sym[:, :, is_anchor].astype(np.int32) - qa),
                       s16[:, :, torch.from_numpy(is_anchor)],
                       torch.from_numpy(delta), s16[:, :, torch.from_numpy(~is_anchor)])


# ---- measuring the size model ------------------------------------------------------------------
def _spread_chunks(layers: int, pages: int, max_chunks: int) -> list[tuple[int, int]]:
    """Up to max_chunks (layer, page) pairs: layers evenly spaced over the depth (at most
    max_chunks / 2 of them, so a caller generating KV layer by layer makes few layers), the
    chunks shared out evenly between them, and in each layer pages spread over the context
    with an offset that moves from layer to layer (early, middle and late positions, sink
    tokens included)."""
    n_layers = min(layers, max(1, max_chunks // 2))
    layer_ids = np.unique(np.linspace(0, layers - 1, n_layers).round().astype(np.int64))
    n = len(layer_ids)
    picks = []
    for i, layer in enumerate(layer_ids):
        count = min(pages, (max_chunks * (i + 1)) // n - (max_chunks * i) // n)
        offset = (i * pages) // n
        picks += [(int(layer), int((offset + j * pages // count) % pages))
                  for j in range(count)]
    return sorted(set(picks))


def _coded_chunk_bytes(segs: list[np.ndarray], heads: int, n_tokens: int) -> int:
    """Real payload bytes of one chunk from its 4 segments' symbols (as `_encode` codes it)."""
    tables, words = _code_chunk(segs)
    return 2 * 2 * heads * n_tokens + sum(len(t) for t in tables) + 4 * int(words.size)


def _tally_segments(tallies: dict[tuple[str, str, int], SegmentTally], segs: list[np.ndarray],
                    bits: tuple[int, int, int], kinds: tuple[str, ...] = ("anchor", "delta")
                    ) -> None:
    """Add each non-empty segment's coded bits and table length to the tally of its
    (tensor, kind, bits)."""
    anchor_bits, kb, vb = bits
    for (tensor, kind), symbols, seg_bits in zip(SEGMENTS, segs, (anchor_bits, kb, anchor_bits,
                                                                   vb), strict=True):
        if symbols.size == 0 or kind not in kinds:
            continue
        lo, freq = _frequency_table(symbols)
        tallies.setdefault((tensor, kind, seg_bits), SegmentTally()).add(
            int(symbols.size), _coded_bits(symbols, freq, lo), int(freq.size))


def measure_ratios(kv: torch.Tensor, page_tokens: int = 256, group_tokens: int = 10,
                   anchor_bits: int = 8) -> CacheGenSizeModel:
    """Rates of every (K/V, anchor/delta, bits 2..8), measured by coding every chunk of `kv`
    (the file `python -m kvsim.bench.cachegen_ratio` writes). Delta segments are measured
    with anchors at `anchor_bits` (the default setting)."""
    shape = KVShape.of(kv)
    tallies: dict[tuple[str, str, int], SegmentTally] = {}
    for bits in range(MIN_BITS, MAX_BITS + 1):
        for kind in ("anchor", "delta"):
            codec = CacheGenCodec(page_tokens=page_tokens, group_tokens=group_tokens,
                                  anchor_bits=bits if kind == "anchor" else anchor_bits,
                                  band_edges=[], k_bits=[bits], v_bits=[bits])
            seg_bits = (codec.params.anchor_bits, bits, bits)
            is_anchor = _token_roles(shape.tokens, page_tokens, group_tokens)[0].numpy()
            for layer in range(shape.layers):
                sym, _ = codec.layer_symbols(kv[layer], layer, shape.layers)
                for t0, t1, _, _ in codec._page_ranges(shape):
                    _tally_segments(tallies, _chunk_segments(sym, is_anchor, t0, t1), seg_bits,
                                    (kind,))
    return CacheGenSizeModel.from_tallies(tallies, {"kind": "measured"}, None, 0)


def write_ratio_file(kv: torch.Tensor, source: dict, path: str | Path = RATIO_FILE,
                     page_tokens: int = 256, group_tokens: int = 10) -> Path:
    """Measure on `kv` and write the rate file; `source` says which KV it was (provenance)."""
    model = measure_ratios(kv, page_tokens, group_tokens)
    doc = {
        "description": "CacheGen size model: entropy-coded bits per quantized symbol and mean "
                       "frequency-table length, per tensor (K/V), segment kind (anchor/delta) "
                       "and bits; used by CacheGenCodec.payload_bytes unless the codec is "
                       "calibrated on the KV at hand (CacheGenCodec.calibrate)",
        "provenance": {"source": source, "shape": KVShape.of(kv).to_dict(),
                       "page_tokens": page_tokens, "group_tokens": group_tokens,
                       "anchor_bits_for_delta": 8,
                       "measured_with": "kvsim.kernels.cachegen.codec.measure_ratios"},
        "ratios": model.to_dict()["ratios"],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path
