"""`bf16`: the uncompressed baseline. Every chunk is the raw bf16 bytes of one layer x page.

payload of chunk (layer l, page p): kv[l, :, :, page tokens, :] as bf16, C-order
[2, kv_heads, page_tokens, head_dim]. Input of another float dtype is rounded to bf16.
Encode and decode are the device path on every device (Codec.encode_device): two strided
copies between the cache and its wire buffer (full pages, then a shorter last page).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.codec import Codec, CodecError, register
from kvsim.kernels.device_wire import nonfinite_status

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

    def pages_encode_alone(self) -> bool:
        return True

    def page_tokens(self, shape: KVShape) -> int:
        return self.params.page_tokens

    def payload_bytes(self, shape: KVShape) -> np.ndarray:
        pages = self.num_pages(shape)
        tokens = np.full(pages, self.params.page_tokens, dtype=np.int64)
        tokens[-1] = shape.tokens - self.params.page_tokens * (pages - 1)
        per_layer = tokens * (2 * shape.kv_heads * shape.head_dim * 2)
        return np.broadcast_to(per_layer, (1, shape.layers, pages)).copy()

    def has_device_path(self, device: torch.device, shape: KVShape) -> bool:
        """Two strided copies put the pages in wire order, on any device."""
        return True

    def _wire_views(self, flat: torch.Tensor, shape: KVShape
                    ) -> list[tuple[torch.Tensor, slice]]:
        """[(view of the bf16 wire buffer [layers, pages, 2, H, t, D], token slice)] for the
        full pages and for a shorter last page."""
        pt, (layers, _, heads, tokens, dim) = self.params.page_tokens, shape.dims
        full, rest = tokens // pt, tokens % pt
        per_layer = flat.view(layers, 2 * heads * tokens * dim)
        out = []
        if full:
            view = per_layer[:, :full * 2 * heads * pt * dim]
            out.append((view.view(layers, full, 2, heads, pt, dim), slice(0, full * pt)))
        if rest:
            view = per_layer[:, full * 2 * heads * pt * dim:]
            out.append((view.view(layers, 1, 2, heads, rest, dim), slice(full * pt, tokens)))
        return out

    def _encode_device(self, kv: torch.Tensor, shape: KVShape
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        status = nonfinite_status(kv)
        x = kv.detach().to(torch.bfloat16)
        buf = torch.empty(2 * shape.numel, dtype=torch.uint8, device=kv.device)
        for view, tokens in self._wire_views(buf.view(torch.bfloat16), shape):
            pages = view.shape[1]
            # kv[:, :, :, tokens] [L, 2, H, pages * t, D] -> [L, pages, 2, H, t, D]
            view.copy_(x[:, :, :, tokens].unflatten(3, (pages, -1)).permute(0, 3, 1, 2, 4, 5))
        return [buf], status

    def _decode_device(self, buffers: list[torch.Tensor], shape: KVShape,
                       dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape.dims, dtype=torch.bfloat16, device=buffers[0].device)
        for view, tokens in self._wire_views(buffers[0].view(torch.bfloat16), shape):
            pages = view.shape[1]
            out[:, :, :, tokens].unflatten(3, (pages, -1)).copy_(view.permute(0, 2, 3, 1, 4, 5))
        self._check_finite(out, self.params.page_tokens)
        return out

    def _check_finite(self, out: torch.Tensor, page_tokens: int) -> None:
        """The payload is the values themselves: refuse NaN / Inf bit patterns (one aminmax
        pass over the whole cache; the chunk is located only when one is found)."""
        lo, hi = torch.aminmax(out)  # NaN propagates
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return
        layer, _, _, token, _ = (int(i) for i in (~torch.isfinite(out)).nonzero()[0])
        raise CodecError(f"bf16: chunk (stream 0, layer {layer}, page {token // page_tokens}) "
                         "holds NaN or Inf values")
