"""`kivi` and `kcvt`: per-channel keys, per-token values, full-precision recent tokens.

Both quantize keys per channel and values per token (groupquant's asymmetric min/max
quantizer, fp16 scale + zero point per group):

- kivi: K groups = `group` consecutive tokens of one channel; V groups = `value_group`
  consecutive channels of one token (0, or more than head_dim = whole head_dim).
- kcvt: K groups = ALL quantized tokens of one channel (one scale/zero per channel per
  layer-head, sent in page 0 of the layer); V groups = the whole head_dim of one token.

Full-precision window (exact rule), kivi's param `window`:
- 'shared' (default; kcvt, gear and oscar always): with T tokens, residual R and key group G
  (kcvt: G=1) the first Tq = max(0, floor((T - R) / G)) * G tokens are quantized; the last
  T - Tq tokens, i.e. the R most recent tokens plus the (T - R) mod G that do not fill a key
  group, are kept in bf16 (T <= R: every token stays bf16). K and V use the same window.
- 'kivi' (the rule of KIVI's code at prefill): keys quantize the first floor(T / R) * R
  tokens and keep the last T mod R in bf16 (T < R: all); values quantize the first
  max(0, T - R) tokens and keep the last R (T <= R: all) in bf16. The windows differ, so
  the chunk layout differs (below).

Chunk (layer l, page p) of the single stream; the page holds q quantized tokens and r
bf16 tokens (q + r = page length; page_tokens is a multiple of G so groups never straddle
pages):
    k_codes  bits-packed  [kv_heads, head_dim, q]         channel-major
    k_scale, k_zero fp16  kivi: [kv_heads, head_dim, q / G]
                          kcvt: [kv_heads, head_dim, 1] in page 0 only (if Tq > 0)
    v_codes  bits-packed  [kv_heads, q, head_dim]
    v_scale, v_zero fp16  [kv_heads, q, head_dim / value_group]
    resid    bf16         [2, kv_heads, r, head_dim]
    ...                   fields added by gear / oscar (see BackboneCodec hooks)
kivi with window 'kivi': the page holds qk / qv quantized and rk / rv bf16 K / V tokens;
k_* fields as above with qk, v_* with qv, then instead of resid:
    k_resid bf16          [kv_heads, rk, head_dim]
    v_resid bf16          [kv_heads, rv, head_dim]

backend (param of kivi / kcvt / oscar / gear; default auto):
'torch' = the torch reference (groupquant.quantize_groups, bitpack), 'cpu' = the numba
kernels of kivi/cpu.py (same bytes, same decoded bits), 'auto' = cpu kernels for CPU tensors.
kivi, kcvt, oscar and gear also take 'triton', their device path (Codec.encode_device: the
Triton kernels of kivi/triton.py write every chunk into one wire buffer on the GPU, same
bytes; kcvt's key stats found first by torch on the device, oscar's tokens rotated and
scaled first, gear's outliers picked by torch and its low-rank fits made by a Triton kernel
(lowrank_triton) around them, batched over runs of pages), which 'auto' takes for CUDA
tensors where it applies (the codes must fill whole bytes; gear: per-page fits and 'ceil'
outliers), else the torch reference runs there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.codec import Codec, register, remember
from kvsim.kernels.device_wire import nonfinite_status
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
from kvsim.kernels.kivi.geometry import (
    G_BASE,
    G_KK,
    G_KR,
    G_KS,
    G_KV,
    G_KZ,
    G_QK,
    G_QV,
    G_RANK,
    G_RK,
    G_RV,
    G_T0,
    G_VR,
    GEO_COLS,
    GEO_FIELDS,
)

if TYPE_CHECKING:
    import torch

    from kvsim.kernels.kivi import cpu as kivi_cpu
else:
    torch = lazy_module("torch")
    kivi_cpu = lazy_module("kvsim.kernels.kivi.cpu")

BACKENDS = ("auto", "torch", "cpu")
# kivi, kcvt, oscar and gear have a device path (Triton kernels of kivi/triton.py; 'auto'
# takes it on CUDA)
KIVI_BACKENDS = (*BACKENDS, "triton")
WINDOWS = ("shared", "kivi")


def use_cpu_kernels(backend: str, device: torch.device) -> bool:
    """kivi_cpu's numba kernels: backend 'cpu', or 'auto' on a CPU tensor."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend == "cpu" or (backend == "auto" and device.type == "cpu")


@dataclass(frozen=True)
class Backbone:
    """The KIVI / KCVT quantizer of one KV cache shape."""

    bits: int
    key_group: int  # tokens per K group; 0 = kcvt (all quantized tokens of the layer)
    value_group: int  # channels per V group; 0 = whole head_dim
    residual: int  # R: most recent tokens kept in bf16
    backend: str = "auto"  # auto | torch | cpu (numba kernels of kivi/cpu.py, same bytes)

    @property
    def kcvt(self) -> bool:
        return self.key_group == 0

    def quantized_tokens(self, tokens: int) -> int:
        g = self.key_group or 1
        return max(0, (tokens - self.residual) // g) * g

    def split(self, shape: KVShape, page_tokens: int, page: int) -> tuple[int, int, int]:
        """(t0, q, r): page start, quantized tokens and bf16 tokens in this page."""
        t0, t1 = page_bounds(shape.tokens, page_tokens, page)
        q = min(max(self.quantized_tokens(shape.tokens) - t0, 0), t1 - t0)
        return t0, q, t1 - t0 - q

    def vgroup(self, shape: KVShape) -> int:
        """Channels per V group: value_group, capped at head_dim (0 = head_dim)."""
        return min(self.value_group or shape.head_dim, shape.head_dim)

    def check_shape(self, shape: KVShape, page_tokens: int, who: str) -> None:
        if shape.head_dim % self.vgroup(shape):
            raise ValueError(f"{who}: head_dim {shape.head_dim} is not a multiple of "
                             f"value_group {self.vgroup(shape)}")
        if self.key_group and page_tokens % self.key_group:
            raise ValueError(f"{who}: page_tokens {page_tokens} must be a multiple of the key "
                             f"group {self.key_group}")

    def fields(self, shape: KVShape, page_tokens: int, page: int) -> list[Field]:
        h, d, b = shape.kv_heads, shape.head_dim, self.bits
        _, q, r = self.split(shape, page_tokens, page)
        if self.kcvt:
            kmeta = (h, d, 1 if page == 0 and self.quantized_tokens(shape.tokens) else 0)
        else:
            kmeta = (h, d, q // self.key_group)
        vmeta = (h, q, d // self.vgroup(shape))
        return [Field("k_codes", "codes", (h, d, q), b), Field("k_scale", "f16", kmeta),
                Field("k_zero", "f16", kmeta), Field("v_codes", "codes", (h, q, d), b),
                Field("v_scale", "f16", vmeta), Field("v_zero", "f16", vmeta),
                Field("resid", "bf16", (2, h, r, d))]

    def quantize(self, xq: torch.Tensor, with_xhat: bool = True
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """xq: [layers, 2, kv_heads, Tq, head_dim] fp32 -> (whole-cache codes/scales keyed
        like the fields, K as [layers, heads, head_dim, Tq(/G)], V as [layers, heads, Tq, .]),
        and the dequantized xq (None unless with_xhat)."""
        tq = xq.shape[3]
        kt = xq[:, 0].transpose(-1, -2)  # [layers, heads, head_dim, Tq]
        kg = self.key_group or max(tq, 1)
        vg = min(self.value_group or xq.shape[-1], xq.shape[-1])
        xhat = None
        if use_cpu_kernels(self.backend, xq.device):
            kc, ks, kz, khat = kivi_cpu.quantize_rows(kt, kg, self.bits, with_xhat)
            vc, vs, vz, vhat = kivi_cpu.quantize_rows(xq[:, 1], vg, self.bits, with_xhat)
            if with_xhat:
                xhat = torch.stack((khat.transpose(-1, -2), vhat), dim=1).to(xq.device)
        else:
            kc, ks, kz = quantize_groups(kt, kg, self.bits)
            vc, vs, vz = quantize_groups(xq[:, 1], vg, self.bits)
            if with_xhat:
                xhat = torch.stack((dequantize_groups(kc, ks, kz, kg).transpose(-1, -2),
                                    dequantize_groups(vc, vs, vz, vg)), dim=1)
        parts = {"k_codes": kc, "k_scale": ks, "k_zero": kz, "v_codes": vc, "v_scale": vs,
                 "v_zero": vz}
        return parts, xhat

    def page_values(self, parts: dict[str, torch.Tensor], layer: int, t0: int, q: int
                    ) -> dict[str, torch.Tensor]:
        """The backbone fields of one page, sliced from `quantize`'s whole-cache parts."""
        g = self.key_group
        out = {"k_codes": parts["k_codes"][layer, :, :, t0:t0 + q],
               "v_codes": parts["v_codes"][layer, :, t0:t0 + q]}
        for key in ("k_scale", "k_zero"):
            out[key] = (parts[key][layer] if self.kcvt else
                        parts[key][layer, :, :, t0 // g:(t0 + q) // g])
        for key in ("v_scale", "v_zero"):
            out[key] = parts[key][layer, :, t0:t0 + q]
        return out

    def dequantize_page(self, f: dict[str, torch.Tensor], q: int,
                        page0: dict[str, torch.Tensor]) -> torch.Tensor:
        """Parsed fields of one page (page0: of page 0, for kcvt's K scales) ->
        [2, heads, q, head_dim] fp32."""
        device = f["v_codes"].device
        deq = (kivi_cpu.dequantize_rows if use_cpu_kernels(self.backend, device)
               else dequantize_groups)
        if self.kcvt:
            k = deq(f["k_codes"], page0["k_scale"], page0["k_zero"], max(q, 1))
        else:
            k = deq(f["k_codes"], f["k_scale"], f["k_zero"], self.key_group)
        d = f["v_codes"].shape[-1]
        vg = min(self.value_group or d, d)
        v = deq(f["v_codes"], f["v_scale"], f["v_zero"], vg)
        return torch.stack((k.transpose(-1, -2), v), dim=0).to(device)


@dataclass
class FusedInput:
    """What a codec feeds kivi_cpu.encode_fused (see BackboneCodec.fused_prepare)."""

    src_k: kivi_cpu.Source | None = None  # K values to quantize (None: the cache)
    src_v: kivi_cpu.Source | None = None  # V values to quantize (None: the cache)
    src_peak: tuple[int, int] = (1, 1)  # src_k / src_v hold the cache's values (peak check)
    norms: tuple[bool, bool] = (False, False)  # oscar: K, V tokens divided by their norms
    rotate: tuple[bool, bool] = (False, False)  # oscar: K, V rotated in the kernel (first)
    select_outliers: bool = False  # gear: outliers picked in the kernel
    lowrank: kivi_cpu.LowRankOut | None = None  # gear: the per-page low-rank fits (filled in)
    peak: float = 0.0  # max |x| the hook saw


class BackboneCodec(Codec):
    """A single-stream codec built on a Backbone. Subclasses provide `backbone()` and may
    override the hooks to add fields (gear: low rank + outliers; oscar: rotation + norms)."""

    # page_extras reads xhat_page (gear: the quantization error); False skips computing
    # the reconstruction at encode (page_extras then gets xhat_page=None)
    uses_xhat = True

    def backbone(self) -> Backbone:
        raise NotImplementedError

    def quant_backend(self) -> str:
        """auto | torch | cpu: the `backend` param where the codec has one, else auto;
        'triton' (a device path) runs as 'auto' where the device path does not apply."""
        backend = getattr(self.params, "backend", "auto")
        return "auto" if backend == "triton" else backend

    def tuned_backbone(self) -> Backbone:
        """backbone() with this codec's backend (subclasses may build it without one)."""
        return dataclasses.replace(self.backbone(), backend=self.quant_backend())

    # ---- hooks ----------------------------------------------------------------------
    def extra_fields(self, shape: KVShape, q: int) -> list[Field]:
        return []

    def pre_quantize(self, xq: torch.Tensor, shape: KVShape) -> tuple[torch.Tensor, Any]:
        """xq: [layers, 2, heads, Tq, head_dim] fp32 -> (tensor to quantize, state)."""
        return xq, None

    def post_quantize(self, state: Any, xq: torch.Tensor, xhat: torch.Tensor | None) -> Any:
        """After the whole cache is quantized (xq, xhat: [layers, 2, heads, Tq, head_dim];
        xhat None unless uses_xhat) -> the state page_extras gets (gear: its low-rank fits)."""
        return state

    def page_extras(self, state: Any, layer: int, t0: int, q: int, x_page: torch.Tensor,
                    xhat_page: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Extra field values of one page (x_page / xhat_page: [2, heads, q, head_dim];
        xhat_page is None when uses_xhat is False)."""
        return {}

    def post_dequantize(self, f: dict[str, torch.Tensor], xhat_page: torch.Tensor
                        ) -> torch.Tensor:
        """Undo pre_quantize on one page's [2, heads, q, head_dim] reconstruction."""
        return xhat_page

    # ---- Codec ----------------------------------------------------------------------
    def stream_names(self) -> list[str]:
        return ["full"]

    def page_tokens(self, shape: KVShape) -> int:
        return self.params.page_tokens

    def check_shape(self, shape: KVShape) -> None:
        self.backbone().check_shape(shape, self.params.page_tokens, self.name)

    def layout(self, shape: KVShape, page: int) -> ChunkLayout:
        bb = self.backbone()
        _, q, _ = bb.split(shape, self.params.page_tokens, page)
        return ChunkLayout(bb.fields(shape, self.params.page_tokens, page)
                           + self.extra_fields(shape, q))

    def payload_bytes(self, shape: KVShape) -> np.ndarray:
        self.check_shape(shape)
        pages = self.num_pages(shape)
        out = np.zeros((1, shape.layers, pages), dtype=np.int64)
        for p in range(pages):
            out[0, :, p] = self.layout(shape, p).nbytes
        return out

    def _check_content(self, enc: Encoded, n: int) -> None:
        """Every fp16 / bf16 field finite, every index field in range (sizes were checked by
        Codec.decode). One layout per page."""
        layouts = [self.layout(enc.shape, p) for p in range(self.num_pages(enc.shape))]
        for c in enc.streams[0]:
            layouts[c.page].check(c.payload, f"{self.name}: chunk (stream 0, layer {c.layer}, "
                                             f"page {c.page})")

    # ---- the device path's shared parts (kivi, kcvt, oscar) ----------------------------
    def _takes_device_path(self, device: torch.device) -> bool:
        """backend 'triton', or 'auto' on CUDA (whether the shape suits the kernels is each
        codec's has_device_path)."""
        backend = self.params.backend
        return backend == "triton" or (backend == "auto" and device.type == "cuda")

    def has_device_path(self, device: torch.device, shape: KVShape) -> bool:
        """backend 'triton' (or 'auto' on CUDA) and a shape whose codes fill whole bytes as
        the backbone's kernels write them (subclasses add their own conditions)."""
        return self._takes_device_path(device) and self._backbone_fills_bytes(shape)

    def _backbone_fills_bytes(self, shape: KVShape) -> bool:
        """kivi: whole key groups and value groups pack into whole bytes; kcvt: each page's
        key rows (a channel's codes along its quantized tokens) and each token's value row
        do."""
        bb = self.backbone()
        per = 8 // bb.bits
        if bb.kcvt:
            return (self.params.page_tokens % per == 0 and shape.head_dim % per == 0
                    and bb.quantized_tokens(shape.tokens) % per == 0)
        return bb.key_group % per == 0 and bb.vgroup(shape) % per == 0

    def _device_wire(self, kv: torch.Tensor, shape: KVShape
                     ) -> tuple[torch.Tensor | None, np.ndarray, torch.Tensor, int, torch.Tensor]:
        """The start of a device encode: (the input's check status, the page geometry, the
        same on the device, bytes per layer, the wire buffer to fill). kv's NaN / Inf and
        fp16 range are checked on the device (nonfinite_status), or now on the CPU."""
        from kvsim.kernels.triton_support import require_kernel_device

        require_kernel_device(kv.device, f"{self.name} triton backend",
                              "use backend 'cpu' or 'auto'")
        status = nonfinite_status(kv, fp16_range=True)
        if status is None:  # on the CPU (interpreter): checked now, as the reference does
            check_fp16_range(kv, self.name)
        geo, geo_dev, layer_bytes = self._device_geometry(shape, kv.device)
        buf = torch.empty(shape.layers * layer_bytes, dtype=torch.uint8, device=kv.device)
        return status, geo, geo_dev, layer_bytes, buf

    def _device_geometry(self, shape: KVShape, device: torch.device
                         ) -> tuple[np.ndarray, torch.Tensor, int]:
        """(geometry, the same on `device`, bytes per layer), built once per shape and
        device: the host work is not repeated in front of every launch."""
        cache = self.__dict__.setdefault("_device_geometries", {})
        key = (shape, str(device))
        entry = cache.get(key)
        if entry is None:
            geo, layer_bytes, _ = self.geometry(shape)
            entry = (geo, torch.from_numpy(geo).to(device), layer_bytes)
            remember(cache, key, entry)
        return entry

    def _window_copy(self, buf: torch.Tensor, cache: torch.Tensor, geo: np.ndarray,
                     layer_bytes: int, to_wire: bool) -> None:
        """Copy the bf16 tokens of every page between the cache (the input when to_wire, else
        the decode's output) and the k_resid / v_resid bytes of the wire buffer: one copy per K / V
        plane of each page that has such tokens (the last one or two)."""
        layers, _, heads, _, dim = cache.shape
        for p in range(geo.shape[0]):
            t0 = int(geo[p, G_T0])
            for plane, q, r, col in ((0, geo[p, G_QK], geo[p, G_RK], G_KR),
                                     (1, geo[p, G_QV], geo[p, G_RV], G_VR)):
                q, r = int(q), int(r)
                if not r:
                    continue
                wire = buf.as_strided((layers, heads, r, 2 * dim),
                                      (layer_bytes, r * 2 * dim, 2 * dim, 1),
                                      int(geo[p, G_BASE] + geo[p, col]))
                tokens = cache[:, plane, :, t0 + q:t0 + q + r]  # [L, H, r, D]
                if to_wire:  # the window alone rounded to bf16
                    wire.copy_(tokens.to(torch.bfloat16).view(torch.uint8))
                else:
                    values = torch.empty(tokens.shape, dtype=torch.bfloat16, device=buf.device)
                    values.view(torch.uint8).copy_(wire)
                    tokens.copy_(values)

    def _key_stats(self, x: torch.Tensor, tq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kcvt: (scale16, zero16) fp16 [layers, heads, head_dim] of each key channel over the
        first tq tokens of x [layers, 2, heads, tokens, head_dim]: groupquant.quantize_groups's
        op sequence, on x's device."""
        kt = x[:, 0, :, :tq].to(torch.float32)  # [L, H, tq, D]
        mn = kt.amin(dim=2) + 0.0  # -0.0 -> +0.0, as the reference
        mx = kt.amax(dim=2) + 0.0
        return (((mx - mn) / float((1 << self.backbone().bits) - 1)).to(torch.float16),
                mn.to(torch.float16))

    def _page0_fields(self, buf: torch.Tensor, shape: KVShape, geo: np.ndarray,
                      layer_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kcvt: views of every layer's k_scale / k_zero bytes (uint8 [layers, heads *
        head_dim * 2], in page 0's chunk) inside the wire buffer."""
        n = shape.kv_heads * shape.head_dim * 2
        return tuple(buf.as_strided((shape.layers, n), (layer_bytes, 1),
                                    int(geo[0, G_BASE] + geo[0, col])) for col in (G_KS, G_KZ))

    def _backbone_kernels(self, x: torch.Tensor, buf: torch.Tensor, shape: KVShape,
                          decode: bool) -> None:
        """The backbone's fields of every chunk of the wire buffer: written from x [layers,
        2, heads, tokens, head_dim] (its first Tq tokens quantized; decode False), or
        dequantized into x (decode True; the bf16 window is _window_copy's). kivi: two
        launches of kivi/triton.py's kernels; kcvt: the keys' per-channel stats found first
        (torch on the device) and given to them, and stored in page 0 / read from it."""
        from kvsim.kernels.kivi import triton as kivi_triton

        bb, pt = self.backbone(), self.params.page_tokens
        geo, geo_dev, layer_bytes = self._device_geometry(shape, buf.device)
        def run(group: int, given: torch.Tensor | None = None) -> None:
            if decode:
                kivi_triton.decode_quantized(buf, x, geo_dev, layer_bytes, pt, group,
                                             bb.vgroup(shape), bb.bits, given)
            else:
                kivi_triton.encode_quantized(x, buf, geo_dev, layer_bytes, pt, group,
                                             bb.vgroup(shape), bb.bits, given)

        if not bb.kcvt:
            run(bb.key_group)
            return
        tq = bb.quantized_tokens(shape.tokens)
        # fp32 [2, L, H, D]: the keys' scales and zero points (none quantized: unused zeros)
        given = torch.zeros(2, shape.layers, shape.kv_heads, shape.head_dim, device=buf.device)
        if tq:
            views = self._page0_fields(buf, shape, geo, layer_bytes)
            if decode:
                for plane, view in enumerate(views):
                    given[plane] = view.contiguous().view(torch.float16).reshape(
                        given.shape[1:]).to(torch.float32)
            else:  # the keys' stats, stored once per layer in page 0
                stats = self._key_stats(x, tq)
                for view, v in zip(views, stats, strict=True):
                    view.copy_(v.contiguous().view(torch.uint8).reshape(view.shape))
                given = torch.stack(stats).to(torch.float32).contiguous()
        run(kivi_triton.KCVT_TOKENS_PER_K_PROGRAM, given)

    def _encode_device(self, kv: torch.Tensor, shape: KVShape
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """kivi, kcvt: the backbone's kernels, then the bf16 window copied by torch."""
        status, geo, _, layer_bytes, buf = self._device_wire(kv, shape)
        x = kv.detach()
        self._backbone_kernels(x, buf, shape, decode=False)
        self._window_copy(buf, x, geo, layer_bytes, True)
        return [buf], status

    def _decode_device(self, buffers: list[torch.Tensor], shape: KVShape,
                       dtype: torch.dtype) -> torch.Tensor:
        from kvsim.kernels.triton_support import interpreting

        buf = buffers[0]
        # bf16 / fp32 straight from the kernels (fp16, and anything interpreted: fp32, then
        # cast by decode_device)
        direct = (dtype if dtype in (torch.bfloat16, torch.float32) and not interpreting()
                  else torch.float32)
        out = torch.empty(shape.dims, dtype=direct, device=buf.device)
        geo, _, layer_bytes = self._device_geometry(shape, buf.device)
        self._backbone_kernels(out, buf, shape, decode=True)
        self._window_copy(buf, out, geo, layer_bytes, False)
        return out

    # ---- the fused CPU path: kivi_cpu.encode_fused / decode_fused -----------------------
    def fused(self, device: torch.device, shape: KVShape) -> bool:
        """Whether encode / decode run the fused CPU kernels (CPU tensors, backend cpu |
        auto, and a configuration they cover: fused_ok)."""
        return (device.type == "cpu" and use_cpu_kernels(self.quant_backend(), device)
                and self.fused_ok(shape))

    def fused_ok(self, shape: KVShape) -> bool:
        return True

    def page_split(self, shape: KVShape, page: int) -> tuple[int, int, int, int, int]:
        """(t0, qk, rk, qv, rv): page start, quantized and bf16 K tokens, same for V."""
        t0, q, r = self.backbone().split(shape, self.params.page_tokens, page)
        return t0, q, r, q, r

    def index_bytes(self, shape: KVShape) -> tuple[int, int]:
        """Bytes per stored outlier index (K, V): gear's u8 / u16 fields."""
        return 1, 1

    def geometry(self, shape: KVShape) -> tuple[np.ndarray, int, list[int]]:
        """(geo int64 [pages, GEO_COLS], bytes per layer, bytes of each page's
        chunk): the token split and field offsets kivi_cpu's fused kernels read."""
        pages = self.num_pages(shape)
        geo = np.full((pages, GEO_COLS), -1, np.int64)
        sizes, base = [], 0
        for p in range(pages):
            lay = self.layout(shape, p)
            t0, qk, rk, qv, rv = self.page_split(shape, p)
            geo[p, :5] = (t0, qk, qv, rk, rv)
            geo[p, G_BASE] = base
            geo[p, [G_RANK, G_KK, G_KV]] = 0
            for f, off in zip(lay.fields, lay.offsets().values(), strict=True):
                if f.name in GEO_FIELDS:
                    geo[p, GEO_FIELDS[f.name]] = off
                elif f.name == "resid":  # [2, heads, r, head_dim] = k_resid then v_resid
                    geo[p, G_KR] = off
                    geo[p, G_VR] = off + shape.kv_heads * rk * shape.head_dim * 2
                if f.name == "lr_a":
                    geo[p, G_RANK] = f.shape[3]
                elif f.name in ("ko_idx", "vo_idx"):  # 'ceil' layout [heads, n, 2k]
                    geo[p, G_KK if f.name == "ko_idx" else G_KV] = f.shape[-1] // 2
            sizes.append(lay.nbytes)
            base += lay.nbytes
        return geo, base, sizes

    def fused_prepare(self, x: torch.Tensor, shape: KVShape, geo: np.ndarray, layer_bytes: int,
                      out: np.ndarray) -> FusedInput:
        """Hook: the sources to quantize (default: the cache itself) and what the kernel does
        to them; may write extra fields into `out` (all chunks, zeroed)."""
        return FusedInput()

    def check_rotated(self, vpeak: float) -> None:
        """Hook: refuse a peak |rotated V| the kernel saw (oscar)."""

    def fused_finish(self, inp: FusedInput, shape: KVShape, geo: np.ndarray, layer_bytes: int,
                     out: np.ndarray) -> None:
        """Hook: after the backbone fields are written (gear: the low-rank fits)."""

    def fused_rotation(self) -> tuple[bool, bool]:
        """Decode: rotate K, V back (oscar)."""
        return False, False

    def _encode_fused(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        if kv.dtype != torch.bfloat16:  # the kernels see the bf16 window only rounded
            check_fp16_range(kv, self.name)
        bb = self.tuned_backbone()
        geo, layer_bytes, sizes = self.geometry(shape)
        out = np.zeros(shape.layers * layer_bytes, np.uint8)
        x = kv.detach()
        inp = self.fused_prepare(x, shape, geo, layer_bytes, out)
        peak, vpeak = kivi_cpu.encode_fused(
            x, geo, layer_bytes, bb.key_group, bb.vgroup(shape), bb.bits, out, inp.src_k,
            inp.src_v, inp.norms, inp.src_peak, inp.rotate, inp.select_outliers,
            inp.lowrank, self.index_bytes(shape))
        peak = max(peak, inp.peak)
        if peak > FP16_MAX:  # check_fp16_range's refusal, from the kernels' peaks
            raise ValueError(f"{self.name}: |value| up to {peak:.4g} exceeds the fp16 range "
                             f"({FP16_MAX}) of the stored scales / zero points")
        self.check_rotated(vpeak)
        self.fused_finish(inp, shape, geo, layer_bytes, out)
        chunks = []
        for layer in range(shape.layers):
            for p, size in enumerate(sizes):
                at = layer * layer_bytes + int(geo[p, G_BASE])
                chunks.append(Chunk(0, layer, p, out[at:at + size]))
        return [chunks]

    def _decode_fused(self, enc: Encoded, dtype: torch.dtype) -> torch.Tensor:
        shape, bb = enc.shape, self.tuned_backbone()
        geo, _, _ = self.geometry(shape)
        payloads = enc.payloads(0)
        src = np.concatenate([np.asarray(payloads[(layer, p)], dtype=np.uint8)
                              for layer in range(shape.layers)
                              for p in range(self.num_pages(shape))])
        return kivi_cpu.decode_fused(src, geo, src.size // shape.layers, shape.dims,
                                     bb.key_group, bb.vgroup(shape), bb.bits, dtype,
                                     self.index_bytes(shape), self.fused_rotation())

    def _decode_to(self, enc: Encoded, streams: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
        if self.fused(device, enc.shape):  # the kernel writes `dtype` directly
            return self._decode_fused(enc, dtype)
        return super()._decode_to(enc, streams, device, dtype)

    def _encode(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        if self.fused(kv.device, shape):
            return self._encode_fused(kv, shape)
        check_fp16_range(kv, self.name)
        bb, pt = self.tuned_backbone(), self.params.page_tokens
        x = kv.detach().to(torch.float32)  # [layers, 2, heads, tokens, head_dim]
        tq = bb.quantized_tokens(shape.tokens)
        fast = use_cpu_kernels(bb.backend, kv.device)
        xq, state = self.pre_quantize(x[:, :, :, :tq], shape)
        parts, xhat = bb.quantize(xq, self.uses_xhat)
        state = self.post_quantize(state, xq, xhat)
        chunks = []
        for layer in range(shape.layers):
            for p in range(self.num_pages(shape)):
                t0, q, r = bb.split(shape, pt, p)
                values = bb.page_values(parts, layer, t0, q)
                values["resid"] = x[layer, :, :, t0 + q:t0 + q + r]
                values.update(self.page_extras(state, layer, t0, q,
                                               xq[layer, :, :, t0:t0 + q],
                                               None if xhat is None else
                                               xhat[layer, :, :, t0:t0 + q]))
                chunks.append(Chunk(0, layer, p, self.layout(shape, p).serialize(values, fast)))
        return [chunks]

    def _decode(self, enc: Encoded, streams: int, device: torch.device) -> torch.Tensor:
        shape, bb, pt = enc.shape, self.tuned_backbone(), enc.page_tokens
        if use_cpu_kernels(bb.backend, device) and device.type == "cpu":
            return self._decode_cpu(enc, bb)
        out = torch.empty(shape.dims, dtype=torch.float32, device=device)
        payloads = enc.payloads(0)
        fast = use_cpu_kernels(bb.backend, device)
        for layer in range(shape.layers):
            parsed = {p: self.layout(shape, p).parse(payloads[(layer, p)], device, fast)
                      for p in range(self.num_pages(shape))}
            for p, f in parsed.items():
                t0, q, r = bb.split(shape, pt, p)
                if q:
                    xhat = bb.dequantize_page(f, q, parsed[0])
                    out[layer, :, :, t0:t0 + q] = self.post_dequantize(f, xhat)
                out[layer, :, :, t0 + q:t0 + q + r] = f["resid"].to(torch.float32)
        return out

    def _decode_cpu(self, enc: Encoded, bb: Backbone) -> torch.Tensor:
        """The CPU decode: kivi_cpu.decode_page dequantizes each chunk's backbone fields
        straight from its bytes (no unpacked codes, no fp32 temporaries)."""
        shape, pt = enc.shape, enc.page_tokens
        out = torch.empty(shape.dims, dtype=torch.float32)
        payloads = enc.payloads(0)
        pages = self.num_pages(shape)
        layouts = [self.layout(shape, p) for p in range(pages)]
        offsets = [lay.offsets() for lay in layouts]
        plain = type(self).post_dequantize is BackboneCodec.post_dequantize
        skip = frozenset(("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"))
        vg = bb.vgroup(shape)
        for layer in range(shape.layers):
            page0 = np.ascontiguousarray(payloads[(layer, 0)], dtype=np.uint8)
            for p in range(pages):
                src = np.ascontiguousarray(payloads[(layer, p)], dtype=np.uint8)
                f = layouts[p].parse(src, out.device, True, skip)
                t0, q, r = bb.split(shape, pt, p)
                if q:
                    view = out[layer, :, :, t0:t0 + q]  # [2, heads, q, head_dim]
                    xhat = view if plain else torch.empty(view.shape, dtype=torch.float32)
                    kmeta, kofs = (page0, offsets[0]) if bb.kcvt else (src, offsets[p])
                    kivi_cpu.decode_page(src, offsets[p], kmeta, kofs, bb.key_group or q, vg,
                                         bb.bits, xhat)
                    if not plain:
                        view.copy_(self.post_dequantize(f, xhat))
                out[layer, :, :, t0 + q:t0 + q + r] = f["resid"].to(torch.float32)
        return out


@dataclass(frozen=True)
class KiviParams:
    bits: int = 2
    group: int = 32  # tokens per key group (per channel)
    value_group: int = 32  # channels per value group (per token); 0 = head_dim
    residual: int = 128  # most recent tokens kept in bf16; a multiple of group
    page_tokens: int = 256  # a multiple of group
    # auto (numba kernels for CPU tensors, the Triton device path for CUDA ones) | torch | cpu
    # | triton; same bytes
    backend: str = "auto"
    window: str = "shared"  # bf16 tokens: 'shared' R + (T-R) mod G of K and V | 'kivi' (see top)

    def __post_init__(self) -> None:
        if self.backend not in KIVI_BACKENDS:
            raise ValueError(f"backend must be one of {KIVI_BACKENDS}")
        if self.bits not in QUANT_BITS:
            raise ValueError(f"bits must be one of {QUANT_BITS}")
        if self.window not in WINDOWS:
            raise ValueError(f"window must be one of {WINDOWS}")
        if self.window == "kivi" and self.residual < 1:
            raise ValueError("window 'kivi' needs residual >= 1 (keys keep T mod residual)")
        if self.group < 1 or self.value_group < 0 or self.residual < 0:
            raise ValueError("group must be >= 1, value_group and residual >= 0")
        if self.residual % self.group or self.page_tokens % self.group or self.page_tokens < 1:
            raise ValueError(f"residual ({self.residual}) and page_tokens ({self.page_tokens}) "
                             f"must be positive multiples of group ({self.group})")


@register
class KiviCodec(BackboneCodec):
    name = "kivi"
    Params = KiviParams
    uses_xhat = False  # no extra fields

    def backbone(self) -> Backbone:
        p = self.params
        return Backbone(p.bits, p.group, p.value_group, p.residual)

    # ---- window 'kivi': K and V keep different bf16 windows ---------------------------
    @property
    def kivi_window(self) -> bool:
        return self.params.window == "kivi"

    def kivi_split(self, shape: KVShape, page: int) -> tuple[int, int, int, int, int]:
        """(t0, qk, rk, qv, rv): page start, quantized and bf16 K tokens, same for V."""
        t0, t1 = page_bounds(shape.tokens, self.params.page_tokens, page)
        big_t, big_r = shape.tokens, self.params.residual
        tqk, tqv = big_t // big_r * big_r, max(0, big_t - big_r)
        qk = min(max(tqk - t0, 0), t1 - t0)
        qv = min(max(tqv - t0, 0), t1 - t0)
        return t0, qk, t1 - t0 - qk, qv, t1 - t0 - qv

    def layout(self, shape: KVShape, page: int) -> ChunkLayout:
        if not self.kivi_window:
            return super().layout(shape, page)
        p, (h, d) = self.params, (shape.kv_heads, shape.head_dim)
        _, qk, rk, qv, rv = self.kivi_split(shape, page)
        kmeta, vmeta = (h, d, qk // p.group), (h, qv, d // self.backbone().vgroup(shape))
        return ChunkLayout([
            Field("k_codes", "codes", (h, d, qk), p.bits), Field("k_scale", "f16", kmeta),
            Field("k_zero", "f16", kmeta), Field("v_codes", "codes", (h, qv, d), p.bits),
            Field("v_scale", "f16", vmeta), Field("v_zero", "f16", vmeta),
            Field("k_resid", "bf16", (h, rk, d)), Field("v_resid", "bf16", (h, rv, d))])

    def page_split(self, shape: KVShape, page: int) -> tuple[int, int, int, int, int]:
        if not self.kivi_window:
            return super().page_split(shape, page)
        return self.kivi_split(shape, page)

    def _encode(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        if not self.kivi_window or self.fused(kv.device, shape):
            return super()._encode(kv, shape)
        check_fp16_range(kv, self.name)
        p, vg = self.params, self.backbone().vgroup(shape)
        fast = use_cpu_kernels(self.quant_backend(), kv.device)
        x = kv.detach().to(torch.float32)  # [layers, 2, heads, tokens, head_dim]
        tqk = shape.tokens // p.residual * p.residual
        tqv = max(0, shape.tokens - p.residual)

        def quant(rows: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
            if fast:
                return kivi_cpu.quantize_rows(rows, group, p.bits, False)[:3]
            return quantize_groups(rows, group, p.bits)

        kc, ks, kz = quant(x[:, 0, :, :tqk].transpose(-1, -2), p.group)  # [L, h, d, Tqk]
        vc, vs, vz = quant(x[:, 1, :, :tqv], vg)  # [L, h, Tqv, d]
        chunks = []
        for layer in range(shape.layers):
            for page in range(self.num_pages(shape)):
                t0, qk, rk, qv, rv = self.kivi_split(shape, page)
                g0, g1 = t0 // p.group, (t0 + qk) // p.group
                values = {"k_codes": kc[layer, :, :, t0:t0 + qk],
                          "k_scale": ks[layer, :, :, g0:g1], "k_zero": kz[layer, :, :, g0:g1],
                          "v_codes": vc[layer, :, t0:t0 + qv],
                          "v_scale": vs[layer, :, t0:t0 + qv], "v_zero": vz[layer, :, t0:t0 + qv],
                          "k_resid": x[layer, 0, :, t0 + qk:t0 + qk + rk],
                          "v_resid": x[layer, 1, :, t0 + qv:t0 + qv + rv]}
                chunks.append(Chunk(0, layer, page,
                                    self.layout(shape, page).serialize(values, fast)))
        return [chunks]

    def _decode(self, enc: Encoded, streams: int, device: torch.device) -> torch.Tensor:
        if not self.kivi_window:
            return super()._decode(enc, streams, device)
        shape, p = enc.shape, self.params
        fast = use_cpu_kernels(self.quant_backend(), device)
        deq = kivi_cpu.dequantize_rows if fast else dequantize_groups
        vg = self.backbone().vgroup(shape)
        out = torch.empty(shape.dims, dtype=torch.float32, device=device)
        for (layer, page), payload in enc.payloads(0).items():
            f = self.layout(shape, page).parse(payload, device, fast)
            t0, qk, rk, qv, rv = self.kivi_split(shape, page)
            if qk:
                k = deq(f["k_codes"], f["k_scale"], f["k_zero"], p.group)  # [h, d, qk]
                out[layer, 0, :, t0:t0 + qk] = k.to(device).transpose(-1, -2)
            if qv:
                out[layer, 1, :, t0:t0 + qv] = deq(f["v_codes"], f["v_scale"], f["v_zero"],
                                                   vg).to(device)
            out[layer, 0, :, t0 + qk:t0 + qk + rk] = f["k_resid"].to(torch.float32)
            out[layer, 1, :, t0 + qv:t0 + qv + rv] = f["v_resid"].to(torch.float32)
        return out


@dataclass(frozen=True)
class KcvtParams:
    bits: int = 4
    residual: int = 0  # most recent tokens kept in bf16 (any count: no token groups)
    page_tokens: int = 256
    # auto (numba kernels for CPU tensors, the device path for CUDA ones) | torch | cpu |
    # triton (the device path); same bytes
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in KIVI_BACKENDS:
            raise ValueError(f"backend must be one of {KIVI_BACKENDS}")
        if self.bits not in QUANT_BITS:
            raise ValueError(f"bits must be one of {QUANT_BITS}")
        if self.residual < 0 or self.page_tokens < 1:
            raise ValueError("residual must be >= 0 and page_tokens >= 1")


@register
class KcvtCodec(BackboneCodec):
    name = "kcvt"
    Params = KcvtParams
    uses_xhat = False  # no extra fields

    def backbone(self) -> Backbone:
        return Backbone(self.params.bits, 0, 0, self.params.residual)

