"""`bf16`: the uncompressed baseline. Every chunk is the raw bf16 bytes of one layer x page.

payload of chunk (layer l, page p): kv[l, :, :, page tokens, :] as bf16, C-order
[2, kv_heads, page_tokens, head_dim]. Input of another float dtype is rounded to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.codec import Codec, CodecError, register
from kvsim.kernels.encoded import Chunk, Encoded

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


@dataclass(frozen=True)
class BF16Params:
    page_tokens: int = 256

    def __post_init__(self) -> None:
        if self.page_tokens < 1:
            raise ValueError("page_tokens must be >= 1")


@register
class BF16Codec(Codec):
    name = "bf16"
    Params = BF16Params

    def stream_names(self) -> list[str]:
        return ["full"]

    def page_tokens(self, shape: KVShape) -> int:
        return self.params.page_tokens

    def payload_bytes(self, shape: KVShape) -> np.ndarray:
        pages = self.num_pages(shape)
        tokens = np.full(pages, self.params.page_tokens, dtype=np.int64)
        tokens[-1] = shape.tokens - self.params.page_tokens * (pages - 1)
        per_layer = tokens * (2 * shape.kv_heads * shape.head_dim * 2)
        return np.broadcast_to(per_layer, (1, shape.layers, pages)).copy()

    def _encode(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        # Bytes of a bf16 tensor, reinterpreted as int16 so numpy can hold them.
        raw = kv.detach().to("cpu", torch.bfloat16).view(torch.int16)
        pt = self.params.page_tokens
        chunks = []
        for layer in range(shape.layers):
            for page in range(self.num_pages(shape)):
                block = raw[layer, :, :, page * pt : (page + 1) * pt, :].contiguous()
                chunks.append(Chunk(0, layer, page, block.numpy().view(np.uint8).reshape(-1)))
        return [chunks]

    def _decode(self, enc: Encoded, streams: int, device: torch.device) -> torch.Tensor:
        shape, pt = enc.shape, enc.page_tokens
        out = torch.empty(shape.dims, dtype=torch.bfloat16)
        for (layer, page), payload in enc.payloads(0).items():
            t0, t1 = page * pt, min((page + 1) * pt, shape.tokens)
            block = torch.from_numpy(payload.copy().view(np.int16)).view(torch.bfloat16)
            out[layer, :, :, t0:t1, :] = block.view(2, shape.kv_heads, t1 - t0, shape.head_dim)
        self._check_finite(out, pt)
        return out.to(device)

    def _check_finite(self, out: torch.Tensor, page_tokens: int) -> None:
        """The payload is the values themselves: refuse NaN / Inf bit patterns (one aminmax
        pass over the whole cache; the chunk is located only when one is found)."""
        lo, hi = torch.aminmax(out)  # NaN propagates
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return
        layer, _, _, token, _ = (int(i) for i in (~torch.isfinite(out)).nonzero()[0])
        raise CodecError(f"bf16: chunk (stream 0, layer {layer}, page {token // page_tokens}) "
                         "holds NaN or Inf values")
