"""`uniform`: asymmetric min/max quantization (INT8/INT4/INT2), at one of three scale scopes.

scope 'group' (default): every (layer, K/V, head, token) row of head_dim values is split
into groups of `group` consecutive channels; each group stores an fp16 scale and an fp16
zero point (its min), and `bits`-bit codes (groupquant.py gives the exact rounding and the
no-NaN rule for constant groups). `group` 0 (or more than head_dim) = one group of
head_dim = one scale per token per head, what vLLM calls per-token-head dynamic scales.
scope 'tensor': one min/max per (layer, K|V) over every head, token and channel of that
layer (vLLM's per-tensor KV-cache scale, asymmetric here: min/max with a zero point, not
absmax), computed at encode over the whole layer; `group` is ignored. Every chunk carries
its layer's two scales and zero points (8 bytes) so that it decodes alone.
One stream; chunk = one layer x one page.

payload of chunk (layer l, page p), t = tokens of the page, D = head_dim, g = groups/row:
    codes  uint8 [2, kv_heads, t, D * bits / 8]   bit-packed along head_dim
    scale  fp16  [2, kv_heads, t, g]    (scope 'tensor': fp16 [2], K then V of layer l)
    zero   fp16  [2, kv_heads, t, g]    (scope 'tensor': fp16 [2])
backend: 'triton' runs the Triton kernels of uniform/triton.py (the device path: one launch
writes the wire buffer, Codec.encode_device), 'cpu' the numba kernels of
uniform/cpu.py (CPU only), 'torch' the reference; 'auto' picks Triton for CUDA tensors and cpu
otherwise.
All give identical bytes and identical decoded tensors. Scope 'tensor' has no kernel: every
backend runs the torch reference for it (on the tensor's device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsim.core.layout import KVShape, check_finite
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.bitpack import pack, unpack
from kvsim.kernels.codec import (
    Codec,
    cast_finite,
    finite_bits,
    register,
)
from kvsim.kernels.device_wire import concat_payloads
from kvsim.kernels.encoded import Chunk, Encoded
from kvsim.kernels.groupquant import (
    FP16_MAX,
    QUANT_BITS,
    ChunkLayout,
    Field,
    check_fp16_range,
    dequantize_groups,
    page_bounds,
    quantize_groups,
)

if TYPE_CHECKING:
    import torch

    from kvsim.kernels.uniform import cpu as uniform_cpu
    from kvsim.kernels.uniform import triton as uniform_triton
else:
    torch = lazy_module("torch")
    uniform_cpu = lazy_module("kvsim.kernels.uniform.cpu")
    uniform_triton = lazy_module("kvsim.kernels.uniform.triton")

BACKENDS = ("auto", "torch", "cpu", "triton")
SCOPES = ("group", "tensor")

# dtype the caller of decode() asked for: the cpu kernel writes it directly (the reference
# returns fp32 and Codec.decode converts it; the kernel rounds the same fp32 values the same way)


@dataclass(frozen=True)
class UniformParams:
    bits: int = 8
    group: int = 64  # channels per group along head_dim; 0 = the whole head_dim
    page_tokens: int = 256
    backend: str = "auto"
    scope: str = "group"  # 'group': per token per `group` channels; 'tensor': per (layer, K|V)

    def __post_init__(self) -> None:
        if self.bits not in QUANT_BITS:
            raise ValueError(f"bits must be one of {QUANT_BITS}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}")
        if self.group < 0:
            raise ValueError("group must be >= 0 (0 = whole head_dim)")
        if self.page_tokens < 1:
            raise ValueError("page_tokens must be >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")


def use_triton(backend: str, device: torch.device) -> bool:
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


def use_cpu(backend: str, device: torch.device) -> bool:
    """The numba kernels: backend 'cpu', or 'auto' on a CPU tensor ('cpu' on a CUDA tensor
    runs on a CPU copy)."""
    return backend == "cpu" or (backend == "auto" and device.type == "cpu")


@register
class UniformCodec(Codec):
    name = "uniform"
    Params = UniformParams

    def stream_names(self) -> list[str]:
        return ["full"]

    def page_tokens(self, shape: KVShape) -> int:
        return self.params.page_tokens

    @property
    def per_tensor(self) -> bool:
        return self.params.scope == "tensor"

    def pages_encode_alone(self) -> bool:
        return not self.per_tensor  # scope 'group': per token

    def group_of(self, shape: KVShape) -> int:
        """Channels per group: `group` capped at head_dim (0 = head_dim); scope 'tensor' packs
        whole rows (head_dim)."""
        if self.per_tensor:
            return shape.head_dim
        return min(self.params.group or shape.head_dim, shape.head_dim)

    def check_shape(self, shape: KVShape) -> None:
        g = self.group_of(shape)
        if shape.head_dim % g:
            raise ValueError(f"uniform: head_dim {shape.head_dim} is not a multiple of the "
                             f"group size {g}")
        if g % (8 // self.params.bits):
            if self.per_tensor:
                raise ValueError(f"uniform: head_dim {g} must be a multiple of "
                                 f"{8 // self.params.bits} for {self.params.bits}-bit packing")
            raise ValueError(f"uniform: group {g} must be a multiple of {8 // self.params.bits} "
                             f"for {self.params.bits}-bit packing")

    def layout(self, shape: KVShape, tokens: int) -> ChunkLayout:
        h, d, bits = shape.kv_heads, shape.head_dim, self.params.bits
        codes = Field("codes", "u8", (2, h, tokens, d * bits // 8))
        if self.per_tensor:
            return ChunkLayout([codes, Field("scale", "f16", (2,)), Field("zero", "f16", (2,))])
        ng = d // self.group_of(shape)
        return ChunkLayout([codes, Field("scale", "f16", (2, h, tokens, ng)),
                            Field("zero", "f16", (2, h, tokens, ng))])

    def payload_bytes(self, shape: KVShape) -> np.ndarray:
        self.check_shape(shape)
        pages = self.num_pages(shape)
        out = np.zeros((1, shape.layers, pages), dtype=np.int64)
        for p in range(pages):
            t0, t1 = page_bounds(shape.tokens, self.params.page_tokens, p)
            out[0, :, p] = self.layout(shape, t1 - t0).nbytes
        return out

    def _check_content(self, enc: Encoded, n: int) -> None:
        """Every scale and zero point finite (sizes were checked by Codec.decode): the f16
        scale and zero fields follow the codes, so one vectorised check per chunk, and the
        per-field check (which names the field) only for a chunk that fails it."""
        shape, layouts = enc.shape, {}
        for c in enc.streams[0]:
            t0, t1 = page_bounds(shape.tokens, self.params.page_tokens, c.page)
            if t1 - t0 not in layouts:
                lay = self.layout(shape, t1 - t0)
                layouts[t1 - t0] = (lay, lay.offsets()["scale"])
            lay, meta_at = layouts[t1 - t0]
            if not finite_bits(c.payload[meta_at:], "f16"):
                lay.check(c.payload, f"uniform: chunk (stream 0, layer {c.layer}, page "
                                     f"{c.page})")

    def chunk_geometry(self, shape: KVShape) -> tuple[int, int]:
        """(bytes of one layer's chunks, bytes of a full-page chunk): chunk (l, p) starts at
        l * layer_bytes + p * full_bytes when chunks are laid end to end in (layer, page)
        order (every page but the last is full)."""
        per_layer = self.wire_sizes(shape)[0, 0]
        return int(per_layer.sum()), int(per_layer[0])

    def _encode(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        if self.per_tensor:
            return self._encode_tensor(kv, shape)
        if use_cpu(self.params.backend, kv.device):
            return self._encode_cpu(kv, shape)
        # the torch reference (backend 'torch'; 'triton' takes the device path)
        check_fp16_range(kv, "uniform")
        g, bits = self.group_of(shape), self.params.bits
        rows = kv.reshape(-1, shape.head_dim)  # [layers*2*heads*tokens, head_dim]
        packed, scale16, zero16 = uniform_triton.quantize_pack_reference(rows, g, bits)
        lead = (shape.layers, 2, shape.kv_heads, shape.tokens)
        packed = packed.reshape(*lead, -1).cpu()
        scale16 = scale16.reshape(*lead, -1).cpu()
        zero16 = zero16.reshape(*lead, -1).cpu()
        chunks = []
        for layer in range(shape.layers):
            for p in range(self.num_pages(shape)):
                t0, t1 = page_bounds(shape.tokens, self.params.page_tokens, p)
                sl = (layer, slice(None), slice(None), slice(t0, t1))
                payload = self.layout(shape, t1 - t0).serialize(
                    {"codes": packed[sl], "scale": scale16[sl], "zero": zero16[sl]})
                chunks.append(Chunk(0, layer, p, payload))
        return [chunks]

    def has_device_path(self, device: torch.device, shape: KVShape) -> bool:
        """The Triton kernels of uniform/triton.py (scope 'group', backend 'triton', or
        'auto' on CUDA) write the wire buffer directly."""
        return not self.per_tensor and use_triton(self.params.backend, device)

    def _encode_device(self, kv: torch.Tensor, shape: KVShape
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        layer_bytes, full_bytes = self.chunk_geometry(shape)
        buf, status = uniform_triton.encode_wire(kv.detach(), self.group_of(shape),
                                                 self.params.bits, self.params.page_tokens,
                                                 layer_bytes, full_bytes)
        return [buf], status

    def _decode_device(self, buffers: list[torch.Tensor], shape: KVShape,
                       dtype: torch.dtype) -> torch.Tensor:
        layer_bytes, full_bytes = self.chunk_geometry(shape)
        # bf16 / fp32 straight from the kernel; fp16 through fp32 (cast_finite clamps)
        direct = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        return uniform_triton.decode_wire(buffers[0], shape.dims, self.group_of(shape),
                                          self.params.bits, self.params.page_tokens,
                                          layer_bytes, full_bytes, direct)

    def _encode_tensor(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        """Scope 'tensor' (torch reference on any backend): one min/max group per (layer, K|V)
        over heads x tokens x head_dim; codes packed along head_dim as in scope 'group'."""
        check_fp16_range(kv, "uniform")
        bits, d = self.params.bits, shape.head_dim
        flat = kv.reshape(shape.layers, 2, -1)  # [layers, 2, heads*tokens*head_dim]
        codes, scale16, zero16 = quantize_groups(flat, flat.shape[-1], bits)
        # scale16, zero16: [layers, 2, 1]
        packed = pack(codes.reshape(*shape.dims[:-1], d), bits).cpu()
        scale16, zero16 = scale16.reshape(shape.layers, 2).cpu(), zero16.reshape(
            shape.layers, 2).cpu()
        chunks = []
        for layer in range(shape.layers):
            for p in range(self.num_pages(shape)):
                t0, t1 = page_bounds(shape.tokens, self.params.page_tokens, p)
                payload = self.layout(shape, t1 - t0).serialize(
                    {"codes": packed[layer, :, :, t0:t1], "scale": scale16[layer],
                     "zero": zero16[layer]})
                chunks.append(Chunk(0, layer, p, payload))
        return [chunks]

    def _decode_tensor(self, enc: Encoded, device: torch.device) -> torch.Tensor:
        """Scope 'tensor': every chunk dequantized with the layer scale / zero it carries."""
        shape, pt, bits, d = enc.shape, enc.page_tokens, self.params.bits, enc.shape.head_dim
        out = torch.empty(shape.dims, dtype=torch.float32, device=device)
        for (layer, p), payload in enc.payloads(0).items():
            t0, t1 = page_bounds(shape.tokens, pt, p)
            f = self.layout(shape, t1 - t0).parse(payload, device)
            codes = unpack(f["codes"], bits, d)  # [2, heads, t, head_dim]
            n = codes[0].numel()
            out[layer, :, :, t0:t1] = dequantize_groups(
                codes.reshape(2, n), f["scale"].reshape(2, 1), f["zero"].reshape(2, 1),
                n).reshape(codes.shape)
        return out

    def _kernel_checks_finite(self, kv: torch.Tensor) -> bool:
        """The numba kernel checks bf16 input for Inf / NaN in its min / max pass."""
        return (not self.per_tensor and kv.dtype == torch.bfloat16
                and use_cpu(self.params.backend, kv.device))

    def _encode_cpu(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        layer_bytes, full_bytes = self.chunk_geometry(shape)
        flat, peak, finite = uniform_cpu.encode_cpu(kv, self.params.page_tokens,
                                                    self.group_of(shape), self.params.bits,
                                                    layer_bytes, full_bytes)
        if not finite:
            check_finite(kv)  # raises the error Codec.encode would have
        if peak > FP16_MAX:  # same refusal as check_fp16_range, from the kernel's group min/max
            raise ValueError(f"uniform: |value| up to {peak:.4g} exceeds the fp16 range "
                             f"({FP16_MAX}) of the stored scales / zero points")
        chunks = []
        for layer in range(shape.layers):
            for p in range(self.num_pages(shape)):
                t0, t1 = page_bounds(shape.tokens, self.params.page_tokens, p)
                off = layer * layer_bytes + p * full_bytes
                chunks.append(Chunk(0, layer, p, flat[off: off + self.layout(shape, t1 - t0)
                                                      .nbytes]))
        return [chunks]

    def _decode_to(self, enc: Encoded, streams: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
        if self.per_tensor:
            return cast_finite(self._decode_tensor(enc, device), dtype)
        if use_cpu(self.params.backend, device):
            return self._decode_cpu(enc, device, dtype)  # the kernel writes `dtype` directly
        return cast_finite(self._decode(enc, streams, device), dtype)

    def _decode_cpu(self, enc: Encoded, device: torch.device,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        """dtype: of the output, fp32 when None."""
        shape = enc.shape
        layer_bytes, full_bytes = self.chunk_geometry(shape)
        parts = enc.payloads(0)  # sizes checked by Codec.decode (exact-size codec)
        src = concat_payloads([parts[(layer, p)] for layer in range(shape.layers)
                               for p in range(self.num_pages(shape))])
        out = uniform_cpu.decode_cpu(src, shape.dims, enc.page_tokens, self.group_of(shape),
                                     self.params.bits, layer_bytes, full_bytes,
                                     dtype or torch.float32)
        return out.to(device)

    def _decode(self, enc: Encoded, streams: int, device: torch.device) -> torch.Tensor:
        if self.per_tensor:
            return self._decode_tensor(enc, device)
        if use_cpu(self.params.backend, device):
            return self._decode_cpu(enc, device)
        shape, pt = enc.shape, enc.page_tokens  # the torch reference ('triton': device path)
        g, bits, d = self.group_of(shape), self.params.bits, shape.head_dim
        packed = torch.empty((shape.layers, 2, shape.kv_heads, shape.tokens, d * bits // 8),
                             dtype=torch.uint8, device=device)
        scale16 = torch.empty((shape.layers, 2, shape.kv_heads, shape.tokens, d // g),
                              dtype=torch.float16, device=device)
        zero16 = torch.empty_like(scale16)
        for (layer, p), payload in enc.payloads(0).items():
            t0, t1 = page_bounds(shape.tokens, pt, p)
            f = self.layout(shape, t1 - t0).parse(payload, device)
            packed[layer, :, :, t0:t1] = f["codes"]
            scale16[layer, :, :, t0:t1] = f["scale"]
            zero16[layer, :, :, t0:t1] = f["zero"]
        out = uniform_triton.unpack_dequantize_reference(
            packed.reshape(-1, d * bits // 8), scale16.reshape(-1, d // g),
            zero16.reshape(-1, d // g), g, bits)
        return out.reshape(shape.dims)
