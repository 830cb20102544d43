"""CacheGen's size model: how many bytes an entropy-coded chunk takes, without coding it.

CacheGen's coded size depends on the KV's statistics, so `CacheGenCodec.payload_bytes`
counts what is fixed exactly (token scales, frequency-table headers) and takes the rest from
a `CacheGenSizeModel`: for every segment kind (K/V, anchor/delta tokens, bits) the coded bits
per symbol and the mean frequency-table length, *measured by entropy coding real chunks*.

Where the measurement comes from decides how far the estimate is from the real bytes: on the
KV it was measured on the error is the word rounding (< 0.1%); on other KV it can be anything
(the shipped file, measured on a SmolLM2 capture, is 1.35x off on heavy-tailed KV and 45x on
constant KV). So every model carries its source and the error measured when it was made:
- `CacheGenSizeModel.load(path)`: a measured file (default data/cachegen_ratio.json);
  its error on other KV is unknown (`expected_error` None), and its source says which KV;
- `CacheGenCodec.calibrate(...)`: a sample encode of (a spread of chunks of) the KV being
  simulated; `expected_error` is the held-out error: half the sampled chunks estimated from
  rates measured on the other half, compared with their real coded sizes (both ways, worst).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.core.data_files import record_loaded
from kvsim.core.paths import DATA_DIR

RATIO_FILE = DATA_DIR / "cachegen_ratio.json"
TENSORS = ("K", "V")
KINDS = ("anchor", "delta")


class SizeModelError(ValueError):
    """A size-model file or measurement that cannot be used (missing rates, bad format)."""


@dataclass(frozen=True)
class SegmentRate:
    """Measured cost of one segment kind: coded bits per symbol, mean frequency-table length."""

    bits_per_symbol: float  # entropy-coder output bits / coded symbols (0: constant segments)
    table_symbols: float  # mean u16 entries of the frequency table (lo..hi span)


@dataclass
class SegmentTally:
    """Running totals of coded segments of one kind (what a SegmentRate is computed from)."""

    symbols: int = 0
    coded_bits: float = 0.0
    table_symbols: int = 0
    segments: int = 0

    def add(self, symbols: int, coded_bits: float, table_symbols: int) -> None:
        self.symbols += symbols
        self.coded_bits += coded_bits
        self.table_symbols += table_symbols
        self.segments += 1

    def merge(self, other: SegmentTally) -> None:
        self.symbols += other.symbols
        self.coded_bits += other.coded_bits
        self.table_symbols += other.table_symbols
        self.segments += other.segments

    def rate(self) -> SegmentRate:
        return SegmentRate(self.coded_bits / self.symbols, self.table_symbols / self.segments)


@dataclass
class CacheGenSizeModel:
    """Rates per (tensor 'K'|'V', kind 'anchor'|'delta', bits) plus where they came from."""

    rates: dict[tuple[str, str, int], SegmentRate]
    source: dict[str, Any]  # which KV was encoded to measure the rates (provenance)
    # relative error of the estimate measured on held-out chunks of that KV (0.02 = 2%);
    # None: not measured (a file's rates applied to other KV: error unknown)
    expected_error: float | None = None
    sampled_chunks: int = 0  # chunks encoded to measure it (0: read from a file)
    extra: dict[str, Any] = field(default_factory=dict)

    def rate(self, tensor: str, kind: str, bits: int) -> SegmentRate:
        try:
            return self.rates[(tensor, kind, bits)]
        except KeyError:
            raise SizeModelError(
                f"cachegen size model ({self.describe()}) has no rate for {tensor}-{kind} at "
                f"{bits} bits; calibrate on KV coded with these bits") from None

    def describe(self) -> str:
        """One line for tables and notes: the source and the expected error."""
        kind = self.source.get("kind", "?")
        what = self.source.get("name") or self.source.get("path") or ""
        err = ("error unknown on other KV" if self.expected_error is None
               else f"held-out error {100 * self.expected_error:.1f}%")
        return f"estimate from {kind} {what}".rstrip() + f" ({err})"

    def to_dict(self) -> dict[str, Any]:
        ratios: dict[str, Any] = {t: {k: {} for k in KINDS} for t in TENSORS}
        for (tensor, kind, bits), r in sorted(self.rates.items()):
            ratios[tensor][kind][str(bits)] = {"bits_per_symbol": r.bits_per_symbol,
                                               "table_symbols": r.table_symbols}
        return {"source": self.source, "expected_error": self.expected_error,
                "sampled_chunks": self.sampled_chunks, "ratios": ratios, **self.extra}

    @classmethod
    def from_tallies(cls, tallies: dict[tuple[str, str, int], SegmentTally],
                     source: dict[str, Any], expected_error: float | None,
                     sampled_chunks: int) -> CacheGenSizeModel:
        rates = {key: t.rate() for key, t in tallies.items() if t.symbols}
        return cls(rates, source, expected_error, sampled_chunks)

    @classmethod
    def load(cls, path: str | Path = RATIO_FILE) -> CacheGenSizeModel:
        """A measured rate file (the format `python -m kvsim.bench.cachegen_ratio` writes)."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
            record_loaded(path)
        except (OSError, json.JSONDecodeError) as exc:
            raise SizeModelError(f"cachegen: cannot read the size-model file {path} ({exc}); "
                                 "re-create it with `python -m kvsim.bench.cachegen_ratio`"
                                 ) from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("ratios"), dict):
            raise SizeModelError(f"cachegen: {path} has no `ratios` section")
        rates = {}
        try:
            for tensor, kinds in doc["ratios"].items():
                for kind, by_bits in kinds.items():
                    for bits, r in by_bits.items():
                        rate = SegmentRate(float(r["bits_per_symbol"]), float(r["table_symbols"]))
                        if not (math.isfinite(rate.bits_per_symbol) and rate.bits_per_symbol >= 0
                                and math.isfinite(rate.table_symbols)
                                and rate.table_symbols >= 0):
                            raise ValueError(f"{tensor}-{kind}-{bits}: {r}")
                        rates[(tensor, kind, int(bits))] = rate
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise SizeModelError(f"cachegen: malformed rate in {path}: {exc}") from exc
        prov = doc.get("provenance") or {}
        source = {"kind": "file", "path": str(path),
                  "measured_on": prov.get("source", doc.get("source", {})).get("kind", "?")}
        return cls(rates, source, doc.get("expected_error"), 0,
                   {"provenance": prov} if prov else {})


def chunk_bytes_estimate(model: CacheGenSizeModel, n_tokens: np.ndarray, n_anchor: np.ndarray,
                         kv_heads: int, head_dim: int, bits: tuple[int, int, int]) -> np.ndarray:
    """Estimated payload bytes of chunks with n_tokens tokens of which n_anchor are group
    anchors (int arrays, one entry per chunk), coded at bits = (anchor, K delta, V delta).
    Layout as CacheGen's payload: fp16 scales [2, H, n], 4 tables (4 + 2 x nsym bytes each),
    then the rANS coder's output in u32 words."""
    anchor_bits, k_bits, v_bits = bits
    n_delta = n_tokens - n_anchor
    row = kv_heads * head_dim  # symbols per token of K (or V)
    coded_bits = np.zeros(n_tokens.shape, dtype=np.float64)
    tables = np.zeros(n_tokens.shape, dtype=np.float64)
    for tensor, delta_bits in (("K", k_bits), ("V", v_bits)):
        for kind, count, seg_bits in (("anchor", n_anchor, anchor_bits),
                                      ("delta", n_delta, delta_bits)):
            rate = model.rate(tensor, kind, seg_bits) if np.any(count > 0) else None
            if rate is None:
                tables += 4
                continue
            coded_bits += count * row * rate.bits_per_symbol
            tables += np.where(count > 0, 4 + 2 * rate.table_symbols, 4)
    scales = 2 * 2 * kv_heads * n_tokens
    # the rANS coder's words: the coded bits, plus its 2-word final state when it coded any
    words = np.where(coded_bits > 0, np.ceil(coded_bits / 32.0) * 4 + 8, 0)
    return (scales + np.round(tables) + words).astype(np.int64)
