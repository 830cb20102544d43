"""Size-only two-stream codecs for simulator tests: an anchor of a fixed share of the bf16
bytes and the residual the rest, per (layer, page) chunk. They produce byte counts only
(the simulator needs nothing else); encoding and decoding raise."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import Codec, register


@dataclass(frozen=True)
class SplitParams:
    page_tokens: int = 64


def size_only_split_codec(name: str, anchor_eighths: int) -> type[Codec]:
    """Register codec `name`: anchor = anchor_eighths / 8 of the bf16 bytes, residual = the
    rest (both whole bytes: a chunk's bf16 bytes are a multiple of 8)."""

    class SizeOnlySplit(Codec):
        Params = SplitParams

        def stream_names(self):
            return ["anchor", "residual"]

        def page_tokens(self, shape):
            return self.params.page_tokens

        def payload_bytes(self, shape: KVShape):
            pages = self.num_pages(shape)
            tok = np.full(pages, self.params.page_tokens, dtype=np.int64)
            tok[-1] = shape.tokens - self.params.page_tokens * (pages - 1)
            bf16 = tok * (2 * shape.kv_heads * shape.head_dim) * 2  # K and V, 2 B/element
            anchor = bf16 * anchor_eighths // 8
            out = np.empty((2, shape.layers, pages), dtype=np.int64)
            out[0], out[1] = anchor, bf16 - anchor
            return out

        def _encode(self, kv, shape):
            raise NotImplementedError("size-only test codec")

        def _decode(self, enc, streams, device):
            raise NotImplementedError("size-only test codec")

    SizeOnlySplit.name = name
    SizeOnlySplit.__name__ = SizeOnlySplit.__qualname__ = f"SizeOnlySplit_{name}"
    return register(SizeOnlySplit)
