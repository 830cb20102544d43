"""`oscar`: Hadamard rotation, THEN per-token L2-norm scaling, then KIVI INT2 (OScaR).

Quantized tokens (the KIVI rule: all but the last R + (T - R) mod G tokens) of every head
are transformed before the KIVI backbone (kivi.py):

1. Canalized rotation: k <- H k (and v <- H v when rotate_values), H the orthonormal
   Walsh-Hadamard matrix of size head_dim (power of two; anything else is refused by
   check_shape with a clear ValueError). Rotation spreads channel outliers over all
   channels.
2. Omni-token scaling: k <- k / n16, n16 = fp16(||k||_2), one scale per token per head
   (also for values when scale_values; off by default since per-token value groups are
   already scale-invariant). A per-token scalar commutes with the rotation, so what
   matters is that the rotation is there: scaling alone can blow a low-norm sink token
   up into channel outliers, the rotation spreads them over all channels.
3. KIVI: per-channel keys in groups of `group` tokens, per-token values in groups of
   `value_group` channels, `bits` bits; the bf16 recent window is stored unrotated.

Decode undoes the scaling, then the rotation (H is its own inverse), so it returns
ordinary unrotated K/V: callers need not rotate queries. A zero-norm token is stored with
n16 = 0 and divided by 1 instead (it is all zeros and decodes to zeros).

Extra fields of chunk (layer, page) with q quantized tokens, after the backbone's:
    k_norm fp16 [kv_heads, q]          v_norm fp16 [kv_heads, q] (only if scale_values)
Rotation runs through the Triton FWHT kernel for CUDA tensors, the torch reference on CPU
with backend 'torch'; the fused CPU path (backend auto / cpu) rotates and scales in numba,
bit for bit as the reference (kivi_cpu._fwht_rows, _token_norms: the norm is a sum of
squares in index order, fp32, then a sqrt rounded to nearest).

The device path (backend 'triton', or 'auto' on CUDA, where kivi's would apply): the
quantized tokens are rotated and scaled by pre_quantize on the device (the FWHT kernel, the
norms in torch), kivi's Triton kernels write the backbone fields of every chunk into the wire
buffer, the norms and the unrotated bf16 window are strided copies; decode mirrors it (kivi's
kernels, then the norms and the rotation back on the quantized tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.codec import register
from kvsim.kernels.groupquant import FP16_MAX, Field
from kvsim.kernels.hadamard import check_hadamard_dim, hadamard
from kvsim.kernels.kivi.codec import Backbone, BackboneCodec, FusedInput, KiviParams
from kvsim.kernels.kivi.geometry import G_KN, G_VN
from kvsim.kernels.kivi.lowrank import seq_sum, sqrt_rn
from kvsim.kernels.kivi.page_runs import chunk_major, page_runs, read_field, run_tokens, write_field

if TYPE_CHECKING:
    import torch

    from kvsim.kernels import hadamard_triton
else:
    torch = lazy_module("torch")
    hadamard_triton = lazy_module("kvsim.kernels.hadamard_triton")


def rotate(x: torch.Tensor) -> torch.Tensor:
    """H x along the last dim, fp32 (Triton on CUDA, torch reference elsewhere)."""
    return hadamard_triton.hadamard(x) if x.device.type == "cuda" else hadamard(x)


def norm_scale_factors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., tokens, d] fp32 -> (divisor [..., tokens] fp32, n16 [..., tokens] fp16): n16 =
    fp16(||x||_2), the divisor n16 (1 for a zero norm). The norm in one defined order, the
    squares summed in index order in fp32 (gear.seq_sum) and the sqrt rounded to nearest
    (gear.sqrt_rn), so that the fused CPU kernel (kivi_cpu._token_norms) gives the same bits
    (vector_norm's order is its own)."""
    # clamp: a norm beyond the fp16 range is stored as FP16_MAX (x / n16 stays finite)
    n16 = sqrt_rn(seq_sum(x * x, -1)).clamp(max=FP16_MAX).to(torch.float16)
    n = n16.to(torch.float32)
    return torch.where(n > 0, n, torch.ones_like(n)), n16


def norm_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., tokens, d] -> (x / n16, n16 [..., tokens] fp16); zero-norm tokens untouched."""
    div, n16 = norm_scale_factors(x)
    return x / div.unsqueeze(-1), n16


@dataclass(frozen=True)
class OscarParams(KiviParams):
    """KIVI's parameters (INT2, group 32, residual window 128) plus the preconditioner's."""

    rotate_values: bool = True
    scale_values: bool = False


@register
class OscarCodec(BackboneCodec):
    name = "oscar"
    Params = OscarParams

    def backbone(self) -> Backbone:
        p = self.params
        return Backbone(p.bits, p.group, p.value_group, p.residual)

    def check_shape(self, shape: KVShape) -> None:
        check_hadamard_dim(shape.head_dim)
        super().check_shape(shape)

    def extra_fields(self, shape: KVShape, q: int) -> list[Field]:
        fields = [Field("k_norm", "f16", (shape.kv_heads, q))]
        if self.params.scale_values:
            fields.append(Field("v_norm", "f16", (shape.kv_heads, q)))
        return fields

    def pre_quantize(self, xq: torch.Tensor, shape: KVShape) -> tuple[torch.Tensor, Any]:
        """xq: [layers, 2, heads, Tq, d] -> rotated, norm-scaled; state = norms
        [layers, 2, heads, Tq] fp16 (V row unused unless scale_values)."""
        k = rotate(xq[:, 0])
        v = rotate(xq[:, 1]) if self.params.rotate_values else xq[:, 1]
        k, kn = norm_scale(k)
        if self.params.scale_values:
            v, vn = norm_scale(v)
        elif self.params.rotate_values:
            # the rotation can grow a token's values by up to sqrt(head_dim): refuse what
            # the fp16 scales / zero points of the V groups cannot hold (they would be inf)
            peak = float(v.abs().max()) if v.numel() else 0.0
            if peak > FP16_MAX:
                raise ValueError(f"oscar: rotated values reach {peak:.4g}, beyond the fp16 range "
                                 f"({FP16_MAX}) of the stored V scales; scale_values=True "
                                 "normalizes them")
        if not self.params.scale_values:
            vn = torch.ones_like(kn)
        return torch.stack((k, v), dim=1), torch.stack((kn, vn), dim=1)

    def fused_prepare(self, x: torch.Tensor, shape: KVShape, geo: np.ndarray, layer_bytes: int,
                      out: np.ndarray) -> FusedInput:
        """Everything in the encode kernel: K (and V if rotate_values) rotated as it is loaded
        (kivi_cpu._fwht_rows, bit-identical to hadamard), K (and V if scale_values) divided by
        the per-token norms it computes as norm_scale_factors does (kivi_cpu._token_norms),
        which writes k_norm / v_norm. The kernel's peaks meet _encode's and pre_quantize's
        refusals in their order (BackboneCodec._encode_fused, check_rotated)."""
        p = self.params
        return FusedInput(norms=(True, p.scale_values), rotate=(True, p.rotate_values))

    def check_rotated(self, vpeak: float) -> None:
        """pre_quantize's refusal of rotated values beyond fp16 (vpeak: the encode kernel's)."""
        if self.params.rotate_values and not self.params.scale_values and vpeak > FP16_MAX:
            raise ValueError(f"oscar: rotated values reach {vpeak:.4g}, beyond the fp16 range "
                             f"({FP16_MAX}) of the stored V scales; scale_values=True "
                             "normalizes them")

    def fused_rotation(self) -> tuple[bool, bool]:
        return True, self.params.rotate_values

    # ---- the device path (kivi/triton.py's kernels on the rotated, scaled tokens) ------
    def _norm_columns(self) -> tuple[tuple[int, int], ...]:
        """(plane, geometry column) of the norms a chunk stores: k_norm (and v_norm)."""
        return ((0, G_KN), (1, G_VN)) if self.params.scale_values else ((0, G_KN),)

    def _encode_device(self, kv: torch.Tensor, shape: KVShape
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        bb = self.backbone()
        status, geo, _, layer_bytes, buf = self._device_wire(kv, shape)
        x = kv.detach().to(torch.float32, copy=True)  # [L, 2, H, T, D]; rotated in place
        tq = bb.quantized_tokens(shape.tokens)
        if tq:  # the quantized tokens rotated and scaled (refusing rotated V beyond fp16)
            pre, norms = self.pre_quantize(x[:, :, :, :tq], shape)  # norms [L, 2, H, Tq]
            for run in page_runs(geo):  # one copy per field and run of pages
                for plane, col in self._norm_columns():
                    write_field(buf, geo, run, col, layer_bytes,
                                chunk_major(run_tokens(norms, run)[:, plane], 2))
            x[:, :, :, :tq] = pre
        self._backbone_kernels(x, buf, shape, decode=False)
        self._window_copy(buf, x, geo, layer_bytes, True)  # past tq: the tokens as given
        return [buf], status

    def _decode_device(self, buffers: list[torch.Tensor], shape: KVShape,
                       dtype: torch.dtype) -> torch.Tensor:
        p, bb, buf = self.params, self.backbone(), buffers[0]
        # fp32 whatever dtype is asked: the norms and the rotation back run on it, as the
        # reference's post_dequantize does (Codec.decode_device casts at the end)
        out = torch.empty(shape.dims, dtype=torch.float32, device=buf.device)
        geo, _, layer_bytes = self._device_geometry(shape, buf.device)
        self._backbone_kernels(out, buf, shape, decode=True)
        self._window_copy(buf, out, geo, layer_bytes, False)
        tq = bb.quantized_tokens(shape.tokens)
        if tq:
            norms = torch.ones(shape.layers, 2, shape.kv_heads, tq, device=buf.device)
            for run in page_runs(geo):
                for plane, col in self._norm_columns():
                    got = read_field(buf, geo, run, col, layer_bytes, shape.layers,
                                     torch.float16, (shape.kv_heads, run.q))  # [L, n, H, q]
                    run_tokens(norms, run)[:, plane].copy_(got.transpose(1, 2))
            k = out[:, 0, :, :tq] * norms[:, 0].unsqueeze(-1)
            v = out[:, 1, :, :tq]
            if p.scale_values:
                v = v * norms[:, 1].unsqueeze(-1)
            if p.rotate_values:
                v = rotate(v)
            out[:, 0, :, :tq] = rotate(k)
            out[:, 1, :, :tq] = v
        return out

    def page_extras(self, state: Any, layer: int, t0: int, q: int, x_page: torch.Tensor,
                    xhat_page: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"k_norm": state[layer, 0, :, t0:t0 + q]}
        if self.params.scale_values:
            out["v_norm"] = state[layer, 1, :, t0:t0 + q]
        return out

    def post_dequantize(self, f: dict[str, torch.Tensor], xhat_page: torch.Tensor
                        ) -> torch.Tensor:
        k = xhat_page[0] * f["k_norm"].to(torch.float32).unsqueeze(-1)
        v = xhat_page[1]
        if self.params.scale_values:
            v = v * f["v_norm"].to(torch.float32).unsqueeze(-1)
        if self.params.rotate_values:
            v = rotate(v)
        return torch.stack((rotate(k), v), dim=0)
