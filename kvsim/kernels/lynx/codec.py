"""`lynx`: the codec class, dispatching each encode / decode to its torch reference
(reference.py), numba (cpu.py) or Triton (triton.py) backend; the format is format.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvsim.core.layout import DTYPES, KVShape, check_finite
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.codec import (
    Codec,
    CodecError,
    cast_finite,
    finite_bits,
    register,
)
from kvsim.kernels.device_wire import nonfinite_status, stream_buffers
from kvsim.kernels.encoded import Chunk, Encoded
from kvsim.kernels.hadamard import check_hadamard_dim, hadamard
from kvsim.kernels.lynx.format import (
    K_MAX,
    K_MIN,
    OSCAR_DECODE_MAX,
    LynxArrays,
    LynxLayout,
    LynxParams,
    LynxTables,
    lynx_tables,
    make_layout,
    read_metadata,
    read_scales,
)
from kvsim.kernels.lynx.reference import decode_torch, encode_torch, oscar_forward, oscar_inverse

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

def _rotation(backend: str, device: torch.device):
    """The Hadamard implementation for a backend: numba on CPU for the cpu backend (bit-identical
    to the torch reference, ~8x faster), the torch reference otherwise."""
    if backend == "cpu" and device.type == "cpu":
        from kvsim.kernels.lynx import cpu as lynx_cpu

        return lynx_cpu.fwht_cpu
    return hadamard


# ---- the codec -----------------------------------------------------------------------------
@register
class LynxCodec(Codec):
    name = "lynx"
    Params = LynxParams

    # ---- description ----
    def params_dict(self) -> dict:
        d = super().params_dict()
        d.pop("backend")  # execution choice: every backend writes the same bytes
        return d

    @property
    def label(self) -> str:
        p = self.params
        tag = "+".join(str(b) for b in p.split)
        return f"lynx-{tag}" + ("-oscar" if p.precondition == "oscar" else "")

    def stream_names(self) -> list[str]:
        n = len(self.params.split)
        if n == 1:
            return ["full"]
        if n == 2:
            return ["anchor", "residual"]
        return ["anchor"] + [f"residual{i}" for i in range(1, n)]

    def page_tokens(self, shape: KVShape) -> int:
        return self.params.page_tokens

    def pages_encode_alone(self) -> bool:
        return True  # per-token groups; oscar's rotation is along head_dim

    @property
    def tables(self) -> LynxTables:
        return lynx_tables(self.params.alpha, self.params.split)

    def layout(self, shape: KVShape) -> LynxLayout:
        return make_layout(shape, self.params)

    def payload_bytes(self, shape: KVShape) -> np.ndarray:
        lay = self.layout(shape)
        out = np.empty((len(self.params.split), shape.layers, lay.pages), dtype=np.int64)
        for p in range(lay.pages):
            out[:, :, p] = np.asarray(lay.page(p).chunk_bytes)[:, None]
        return out

    def check_shape(self, shape: KVShape) -> None:
        if self.params.precondition == "oscar":
            check_hadamard_dim(shape.head_dim)

    def _check_content(self, enc: Encoded, n: int) -> None:
        """Anchor metadata of every chunk (sizes were checked by Codec.decode): page minima
        (fp32), token scales and sigmas (fp16) finite, page exponents k in [K_MIN, K_MAX].
        Codes need no check: every bit pattern is a valid code."""
        lay = self.layout(enc.shape)
        ch = 2 * enc.shape.kv_heads * enc.shape.head_dim
        for c in enc.streams[0]:
            pl = lay.page(c.page)
            where = f"lynx: chunk (stream 0, layer {c.layer}, page {c.page})"
            b = c.payload
            for name, off, end, kind in (("lo", pl.lo_off, pl.scale_off, "f32"),
                                         ("token scales", pl.scale_off, pl.mu_off, "f16"),
                                         ("sigma", pl.sigma_off, pl.k_off, "f16")):
                if not finite_bits(b[off:end], kind):
                    raise CodecError(f"{where}: {name} holds NaN or Inf")
            k = b[pl.k_off: pl.k_off + ch].view(np.int8)
            if k.size and (int(k.min()) < K_MIN or int(k.max()) > K_MAX):
                raise CodecError(f"{where}: page exponent k out of [{K_MIN}, {K_MAX}] "
                                 f"(min {int(k.min())}, max {int(k.max())})")

    # ---- backends ----
    def _backend(self, device: torch.device, shape: KVShape) -> str:
        b = self.params.backend
        if b == "auto":
            if device.type != "cuda":
                return "cpu"
            triton_ok = shape.head_dim % 8 == 0 and len(self.params.split) <= 3
            return "triton" if triton_ok else "torch"
        return b

    def _kernel_checks_finite(self, kv: torch.Tensor) -> bool:
        """The numba kernels check the input for Inf / NaN: the hierarchy's bf16 page min /
        max, the oscar kernel's max |x| (any dtype)."""
        if kv.device.type != "cpu" or self._backend(kv.device, KVShape.of(kv)) != "cpu":
            return False
        return self.params.precondition == "oscar" or kv.dtype == torch.bfloat16

    def _precondition(self, kv: torch.Tensor, backend: str
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the tensor the hierarchy quantizes, oscar's token scales or None)."""
        p = self.params
        if p.precondition == "oscar" and backend == "cpu" and kv.device.type == "cpu":
            from kvsim.kernels.lynx import cpu as lynx_cpu

            return lynx_cpu.oscar_forward_cpu(kv, p.oscar_targets)  # fused, same bits
        if p.precondition == "oscar":
            return oscar_forward(kv.detach().to(torch.float32), p.oscar_targets,
                                 _rotation(backend, kv.device))
        return kv.detach(), None

    def has_device_path(self, device: torch.device, shape: KVShape) -> bool:
        """The Triton kernels (backend 'triton', or 'auto' on CUDA where they apply) write the
        codes into the stream buffers; the metadata follows in a few strided copies."""
        return self._backend(device, shape) == "triton"

    def _encode_device(self, kv: torch.Tensor, shape: KVShape
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        from kvsim.kernels.lynx import triton as lynx_triton

        if self.params.precondition == "oscar":
            # the rotation reads max |x| on the host anyway: check first, for the error
            # naming the bad value rather than the rotation's range refusal
            check_finite(kv)
            status = None
        else:
            status = nonfinite_status(kv)
        x, scales = self._precondition(kv, "triton")
        arr = lynx_triton.encode_triton(x, self.layout(shape), self.tables, scales)
        return arr.buffers, status

    def _decode_device(self, buffers: list[torch.Tensor], shape: KVShape,
                       dtype: torch.dtype) -> torch.Tensor:
        from kvsim.kernels.lynx import triton as lynx_triton

        lay, tab = self.layout(shape), self.tables
        arr = read_metadata(buffers[0], lay)
        arr.buffers = list(buffers)
        out = lynx_triton.decode_triton(arr, lay, tab, len(buffers))
        return self._finish_decode(out, arr.scales, shape, "triton", dtype == torch.bfloat16)

    def _encode(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        lay, tab = self.layout(shape), self.tables
        backend = self._backend(kv.device, shape)  # torch or cpu: triton is the device path
        x, scales = self._precondition(kv, backend)
        if backend == "torch":
            arr = encode_torch(x.to(torch.float32), lay, tab, scales)
        else:
            from kvsim.kernels.lynx import cpu as lynx_cpu

            arr = lynx_cpu.encode_cpu(x.cpu(), lay, tab, scales)
        return self._chunks(arr, lay)

    def _chunks(self, arr: LynxArrays, lay: LynxLayout) -> list[list[Chunk]]:
        streams = []
        for s, buf in enumerate(arr.buffers):
            flat = buf.cpu().numpy()
            chunks = []
            for layer in range(lay.shape.layers):
                for page in range(lay.pages):
                    off = lay.chunk_offset(s, layer, page)
                    n = lay.page(page).chunk_bytes[s]
                    chunks.append(Chunk(s, layer, page, flat[off: off + n]))
            streams.append(chunks)
        return streams

    def _decode_to(self, enc: Encoded, streams: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
        """The cpu oscar path rounds to bf16 in its last pass when bf16 is asked for."""
        out = self._decode(enc, streams, device, bf16=dtype == torch.bfloat16)
        return cast_finite(out, dtype)

    def _decode(self, enc: Encoded, streams: int, device: torch.device,
                bf16: bool = False) -> torch.Tensor:
        """bf16: the caller wants bfloat16; a path that can write it directly may return it
        (every path returns values clamped to the encoded dtype's finite range)."""
        p = self.params
        lay, tab = self.layout(enc.shape), self.tables
        backend = self._backend(device, enc.shape)  # torch or cpu: triton is the device path
        work = torch.device("cpu") if backend == "cpu" else device  # where the kernel runs
        bufs = stream_buffers(enc, streams, work)  # one buffer per stream, (layer, page) order
        if backend == "cpu":
            from kvsim.kernels.lynx import cpu as lynx_cpu

            # bf16 straight from the kernel only when bf16 is asked for (fp32 asked for a
            # bf16 cache gets the unrounded values, as from the reference)
            direct = bf16 and enc.shape.dtype == "bfloat16" and p.precondition == "none"
            out = lynx_cpu.decode_cpu(bufs, lay, tab, streams, bf16=direct)
            scales = read_scales(bufs[0], lay)
        else:
            arr = read_metadata(bufs[0], lay)
            arr.buffers = bufs
            scales = arr.scales
            out = decode_torch(arr, lay, tab, streams)
        return self._finish_decode(out, scales, enc.shape, backend, bf16).to(device)

    def _finish_decode(self, out: torch.Tensor, scales: torch.Tensor | None, shape: KVShape,
                       backend: str, bf16: bool) -> torch.Tensor:
        """Undo oscar's preconditioning and clamp to the encoded dtype's finite range."""
        p = self.params
        big = torch.finfo(DTYPES[shape.dtype]).max
        if p.precondition == "oscar" and backend == "cpu" and out.device.type == "cpu":
            from kvsim.kernels.lynx import cpu as lynx_cpu

            # both clamps and the inverse preconditioning below in one pass, same bits
            return lynx_cpu.oscar_inverse_cpu(out, scales, p.oscar_targets, OSCAR_DECODE_MAX,
                                              big, bf16=bf16)
        if p.precondition == "oscar":
            out = oscar_inverse(out.clamp_(-OSCAR_DECODE_MAX, OSCAR_DECODE_MAX), scales,
                                p.oscar_targets, _rotation(backend, out.device))
            return out.clamp_(-big, big)
        if out.dtype == torch.float32:  # else: already in the encoded dtype, clamped, rounded
            return out.clamp_(-big, big)
        return out
