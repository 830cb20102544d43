"""Shared pieces of the group-quantization codecs (uniform, kivi/kcvt, gear, oscar).

1. The asymmetric min/max group quantizer, pure-torch reference. Its rounding is designed
   so the Triton kernel (uniform/triton.py) reproduces the codes bit for bit:

       mn, mx   = min, max of the group (fp32, exact; a -0.0 result becomes +0.0)
       scale16  = fp16((mx - mn) / qmax)        qmax = 2**bits - 1, IEEE division
       zero16   = fp16(mn)                      round-to-nearest-even casts
       code     = clamp(floor((x - zero16) / scale16 + 0.5), 0, qmax)   IEEE division
       x_hat    = zero16 + code * scale16       (code * scale16 is exact in fp32:
                                                 <= 8 + 11 significant bits)

   Constant groups (scale16 == 0, also when the range underflows fp16) get code 0 and
   decode to zero16: no division by zero, no NaN. Error per element is at most
   scale16 / 2 plus the fp16 rounding of zero16 and of the scale (tests/test_uniform.py).
   Metadata is fp16, so inputs must lie within +-FP16_MAX (clear ValueError otherwise).

2. `ChunkLayout`: the ordered fields of one chunk payload (packed codes, fp16 scales,
   bf16 residual tokens, indices...). The same object computes the payload size from
   the shape alone, serializes, and parses, so sizes are exact by construction.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.bitpack import pack, packed_len, unpack

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

FP16_MAX = 65504.0
QUANT_BITS = (2, 4, 8)  # 1-bit would overflow the fp16 scale for full-range groups


def qmax_of(bits: int) -> int:
    if bits not in QUANT_BITS:
        raise ValueError(f"quantization bits must be one of {QUANT_BITS}, got {bits}")
    return (1 << bits) - 1


def check_fp16_range(x: torch.Tensor, what: str) -> None:
    """fp16 scales / zero points cannot represent |x| > 65504: refuse instead of emitting inf."""
    peak = float(x.abs().max()) if x.numel() else 0.0
    if peak > FP16_MAX:
        raise ValueError(f"{what}: |value| up to {peak:.4g} exceeds the fp16 range ({FP16_MAX}) "
                         "of the stored scales / zero points")


# ---- the quantizer (torch reference) ------------------------------------------------------
def quantize_groups(x: torch.Tensor, group: int, bits: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., n] float (n % group == 0) -> codes uint8 [..., n], scale16 / zero16 fp16
    [..., n // group]. Groups are consecutive runs of `group` elements of the last dim."""
    qmax = qmax_of(bits)
    n = x.shape[-1]
    if group < 1 or n % group:
        raise ValueError(f"last dim {n} is not a multiple of the group size {group}")
    xg = x.to(torch.float32).reshape(*x.shape[:-1], n // group, group)
    # + 0.0 turns a -0.0 min / max into +0.0: which zero amin / amax return for a group
    # holding both is implementation-defined, so the bytes would differ between backends
    mn = xg.amin(dim=-1) + 0.0
    mx = xg.amax(dim=-1) + 0.0
    scale16 = ((mx - mn) / float(qmax)).to(torch.float16)
    zero16 = mn.to(torch.float16)
    s = scale16.to(torch.float32).unsqueeze(-1)
    z = zero16.to(torch.float32).unsqueeze(-1)
    live = s > 0
    v = (xg - z) / torch.where(live, s, torch.ones_like(s))
    codes = torch.where(live, torch.floor(v + 0.5).clamp(0, qmax), torch.zeros_like(v))
    return codes.to(torch.uint8).reshape(x.shape), scale16, zero16


def dequantize_groups(codes: torch.Tensor, scale16: torch.Tensor, zero16: torch.Tensor,
                      group: int) -> torch.Tensor:
    """Inverse of quantize_groups: codes [..., n] -> fp32 [..., n]."""
    n = codes.shape[-1]
    c = codes.to(torch.float32).reshape(*codes.shape[:-1], n // group, group)
    out = zero16.to(torch.float32).unsqueeze(-1) + c * scale16.to(torch.float32).unsqueeze(-1)
    return out.reshape(codes.shape)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flatten codes and pack them (zero-padded to a whole byte) -> 1-D uint8."""
    flat = codes.reshape(-1)
    per = 8 // bits
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return pack(flat, bits)


def unpack_codes(packed: torch.Tensor, bits: int, shape: tuple[int, ...]) -> torch.Tensor:
    n = int(np.prod(shape)) if shape else 1
    return unpack(packed, bits, n).reshape(shape)


# ---- chunk payload layout -----------------------------------------------------------------
# kind: (bytes per element, numpy view of the bytes, torch dtype's name in the torch module)
_ELEM = {"f16": (2, np.float16, "float16"), "bf16": (2, np.int16, "bfloat16"),
         "u8": (1, np.uint8, "uint8"), "u16": (2, np.int16, "int16")}


@dataclass(frozen=True)
class Field:
    """One section of a payload. kind: 'codes' (bit-packed, `bits`), f16, bf16, u8, u16."""

    name: str
    kind: str
    shape: tuple[int, ...]
    bits: int = 0
    limit: int = 0  # u8 / u16 index fields: every value must be < limit (0: unchecked)

    @functools.cached_property
    def count(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        if self.count == 0:
            return 0
        if self.kind == "codes":
            return packed_len(self.count, self.bits)
        return self.count * _ELEM[self.kind][0]


class ChunkLayout:
    """Ordered payload fields; empty fields (a 0 in the shape) take no bytes."""

    def __init__(self, fields: list[Field]) -> None:
        self.fields = fields

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def serialize(self, values: dict[str, torch.Tensor], cpu_kernels: bool = False
                  ) -> np.ndarray:
        """cpu_kernels: pack codes with kivi_cpu's numba kernel (same bytes as pack_codes)."""
        from kvsim.kernels.bitpack_cpu import pack_flat  # imports groupquant: import here

        parts = []
        for f in self.fields:
            if f.nbytes == 0:
                continue
            t = values[f.name].detach().to("cpu")
            if f.kind == "codes":
                raw = pack_flat(t, f.bits) if cpu_kernels else pack_codes(t, f.bits).numpy()
            elif f.kind == "bf16":
                raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
            elif f.kind == "u16":
                raw = t.to(torch.int32).to(torch.int16).contiguous().numpy()
            else:
                raw = t.to(getattr(torch, _ELEM[f.kind][2])).contiguous().numpy()
            raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
            if raw.nbytes != f.nbytes:
                raise AssertionError(f"field {f.name}: {raw.nbytes} bytes, layout says {f.nbytes}")
            parts.append(raw)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)

    def check(self, payload: np.ndarray, where: str) -> None:
        """Validate untrusted payload contents before anything reads them: the size, every
        f16 / bf16 value finite, every index field below its limit (one vectorised pass per
        field). Raises CodecError naming `where` and the field."""
        from kvsim.kernels.codec import CodecError, finite_bits

        if payload.nbytes != self.nbytes:
            raise CodecError(f"{where}: payload is {payload.nbytes} bytes, expected {self.nbytes}")
        off = 0
        for f in self.fields:
            raw = payload[off: off + f.nbytes]
            off += f.nbytes
            if f.nbytes == 0:
                continue
            if f.kind in ("f16", "bf16") and not finite_bits(raw, f.kind):
                raise CodecError(f"{where}: field {f.name} holds NaN or Inf")
            if f.limit and f.kind in ("u8", "u16"):
                top = int(np.ascontiguousarray(raw).view("u1" if f.kind == "u8" else "<u2")
                          .max())
                if top >= f.limit:
                    raise CodecError(f"{where}: field {f.name} holds index {top}, must be < "
                                     f"{f.limit}")

    def offsets(self) -> dict[str, int]:
        """Byte offset of each field in the payload."""
        out, off = {}, 0
        for f in self.fields:
            out[f.name] = off
            off += f.nbytes
        return out

    def parse(self, payload: np.ndarray, device: torch.device, cpu_kernels: bool = False,
              skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """payload -> {name: tensor} (codes unpacked to uint8, u16 widened to int64).
        cpu_kernels: unpack codes with kivi_cpu's numba kernel (same codes as unpack_codes).
        skip: fields left out of the result (a caller that reads them from the bytes)."""
        from kvsim.kernels.bitpack_cpu import unpack_flat
        from kvsim.kernels.codec import CodecError

        if payload.nbytes != self.nbytes:
            raise CodecError(f"chunk payload is {payload.nbytes} bytes, expected {self.nbytes}")
        out: dict[str, torch.Tensor] = {}
        off = 0
        buf = np.ascontiguousarray(payload, dtype=np.uint8)
        for f in self.fields:
            raw = buf[off: off + f.nbytes]
            off += f.nbytes
            if f.name in skip:
                continue
            if f.count == 0:
                dt = torch.uint8 if f.kind in ("codes", "u8") else torch.float32
                out[f.name] = torch.zeros(f.shape, dtype=dt, device=device)
                continue
            if f.kind == "codes" and cpu_kernels:
                t = unpack_flat(raw, f.bits, f.count)
            elif f.kind == "codes":
                t = unpack_codes(torch.from_numpy(raw.copy()), f.bits, f.shape)
            elif f.kind == "bf16":
                t = torch.from_numpy(raw.copy().view(np.int16)).view(torch.bfloat16)
            elif f.kind == "u16":
                t = torch.from_numpy(raw.copy().view(np.uint16).astype(np.int64))
            else:
                t = torch.from_numpy(raw.copy().view(_ELEM[f.kind][1]))
            out[f.name] = t.reshape(f.shape).to(device)
        return out


def page_bounds(tokens: int, page_tokens: int, page: int) -> tuple[int, int]:
    """[t0, t1) token range of a page (the last page may be shorter)."""
    return page * page_tokens, min((page + 1) * page_tokens, tokens)
