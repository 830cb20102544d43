"""`gear` and `gear-l`: a KIVI/KCVT backbone plus error reduction (GEAR).

Per page of quantized tokens (q tokens, heads h, head_dim d), for K and V separately:

1. gear only, outliers: the top and the bottom k entries of every K channel (over the
   page's q tokens) and of every V token (over head_dim) are kept exactly in fp16 with
   their index. `outlier_count` 'ceil' (default): k = min(ceil(s / 200 * n), (n - 1) // 2)
   for every vector of length n, so s = 2 % keeps 2.34 % of keys over 256-token pages and
   3.13 % of values at head_dim 64. 'exact': s % of the entries, as the paper defines
   Filter_s: the m vectors of one (head, page) get k_i = floor((i + 1) c) - floor(i c) per
   side, c = s / 200 * n (each capped at (n - 1) // 2), i.e. floor(m c) per side in all.
   Before quantization each outlier slot is filled with clamp(0, min, max) of the
   vector's remaining entries, so outliers do not widen the groups' ranges; decode
   writes the stored values back over those slots.
2. low rank: the quantization residual E = X_filled - dequant(quant(X_filled)) (zero on
   the outlier slots) of each head is approximated by A B^T, A [q, r], B [d, r],
   r = min(rank, q, d), by subspace (power) iteration: B0 ~ N(0, 1) from a generator seeded
   with `seed`, then `iters` times B = orth(B); A = orth(E B); B = E^T A (GEAR Algorithm 2
   with an orthonormalization each round for stability; orth = modified Gram-Schmidt, and
   every dot product of the fit summed in index order, elementwise fp32 ops, so that the
   torch reference and the numba kernel of the CPU path give the same bits; decode sums
   A B^T's rank-one terms in rank order for the same reason). A and B are stored in fp16;
   among equal values, outliers are picked lower index first (a stable sort). A column
   of B that would overflow fp16 (inputs near +-65504) trades a power of two with its
   column of A first (`fit_fp16`; the product is unchanged).
   `lowrank` 'page' (default): factors are fitted over one page's q tokens (E of one
   head and page is [q, d]), so every page has its own A and B. 'sequence' (as in the
   paper): one fit per layer, K|V and head over all Tq quantized tokens (E is [Tq, d],
   outlier slots of every page zeroed), r = min(rank, Tq, d); chunk p carries A's rows of
   its q tokens and the whole B (the same in every chunk of the layer, so that each chunk
   decodes alone: the same bytes per chunk as 'page').

Extra fields of chunk (layer, page), after the backbone's (kivi.py):
    lr_a  fp16 [2, heads, q, r]        lr_b  fp16 [2, heads, head_dim, r (0 if q == 0)]
    gear only:
    ko_idx u8/u16 [heads, head_dim, 2 kK]   token index in page (u16 if page_tokens > 256)
    ko_val fp16   [heads, head_dim, 2 kK]
    vo_idx u8/u16 [heads, q, 2 kV]          channel index (u16 if head_dim > 256)
    vo_val fp16   [heads, q, 2 kV]
    ('exact': [heads, 2 sum_i k_i], vector by vector: its k_i top entries, then its k_i
    bottom ones; with equal k_i these are the bytes of the 'ceil' layout)
The bf16 recent-token window of the backbone is stored as is (no low rank, no outliers).

Device path (backend 'triton', or 'auto' on CUDA; lowrank 'page' and outlier_count 'ceil',
where the backbone's kernels apply): a whole cache encoded into its wire buffer on its
device by torch (outliers, fields) and Triton kernels (the backbone's; the fit's,
lowrank_triton), batched over runs of pages so that the launches do not grow with the cache
(GearCodec._encode_device); the same bytes and decoded bits. The other settings run this
torch reference on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.codec import register
from kvsim.kernels.groupquant import QUANT_BITS, Field
from kvsim.kernels.kivi.codec import KIVI_BACKENDS, Backbone, BackboneCodec, FusedInput
from kvsim.kernels.kivi.geometry import (
    G_BASE,
    G_KOI,
    G_KOV,
    G_LA,
    G_LB,
    G_QK,
    G_RANK,
    G_VOI,
    G_VOV,
)
from kvsim.kernels.kivi.lowrank import fit_fp16, low_rank, low_rank_product, low_rank_start
from kvsim.kernels.kivi.outliers import (
    index_dtype,
    index_kind,
    loaded_index,
    outlier_schedule,
    outlier_side_counts,
    outliers_per_side,
    ragged_vectors,
    restore_outliers,
    scatter_ragged,
    split_outliers,
    split_outliers_ragged,
    stored_index,
)
from kvsim.kernels.kivi.page_runs import (
    chunk_major,
    page_runs,
    read_field,
    run_tokens,
    write_field,
)

if TYPE_CHECKING:
    import torch

    from kvsim.kernels.kivi import cpu as kivi_cpu
else:
    torch = lazy_module("torch")
    kivi_cpu = lazy_module("kvsim.kernels.kivi.cpu")

BACKBONES = ("kivi", "kcvt")
LOWRANK_SCOPES = ("page", "sequence")
OUTLIER_COUNTS = ("ceil", "exact")


@dataclass(frozen=True)
class GearParams:
    backbone: str = "kivi"  # kivi | kcvt
    bits: int = 2
    group: int = 32  # kivi key group (tokens); ignored by kcvt
    value_group: int = 32  # kivi value group (channels); kcvt uses the whole head_dim
    residual: int = 128  # bf16 recent tokens (kivi: a multiple of group)
    rank: int = 4
    iters: int = 3  # power iterations
    outlier_pct: float = 2.0  # s: % of each vector kept as outliers (s/2 at each end)
    seed: int = 0
    page_tokens: int = 256
    # auto | torch | cpu: the backbone quantizer's kernels | triton: the device path
    # (GearCodec._encode_device; 'auto' takes it on CUDA where it applies); same bytes
    backend: str = "auto"
    lowrank: str = "page"  # low-rank fit per 'page' (A, B per page) | 'sequence' (the paper)
    outlier_count: str = "ceil"  # per vector: 'ceil' of s% of n | 'exact' s% per head-page

    def __post_init__(self) -> None:
        if self.backend not in KIVI_BACKENDS:
            raise ValueError(f"backend must be one of {KIVI_BACKENDS}")
        if self.lowrank not in LOWRANK_SCOPES:
            raise ValueError(f"lowrank must be one of {LOWRANK_SCOPES}")
        if self.outlier_count not in OUTLIER_COUNTS:
            raise ValueError(f"outlier_count must be one of {OUTLIER_COUNTS}")
        if self.backbone not in BACKBONES:
            raise ValueError(f"backbone must be one of {BACKBONES}")
        if self.bits not in QUANT_BITS:
            raise ValueError(f"bits must be one of {QUANT_BITS}")
        if self.rank < 1 or self.iters < 1:
            raise ValueError("rank and iters must be >= 1")
        if not 0 <= self.outlier_pct < 100:
            raise ValueError("outlier_pct must be in [0, 100)")
        if self.page_tokens < 1 or self.residual < 0 or self.group < 1:
            raise ValueError("page_tokens, group must be >= 1 and residual >= 0")
        if self.backbone == "kivi" and (self.residual % self.group
                                        or self.page_tokens % self.group):
            raise ValueError(f"kivi backbone: residual ({self.residual}) and page_tokens "
                             f"({self.page_tokens}) must be multiples of group ({self.group})")


@register
class GearCodec(BackboneCodec):
    name = "gear"
    Params = GearParams
    sparse = True

    def backbone(self) -> Backbone:
        p = self.params
        if p.backbone == "kcvt":
            return Backbone(p.bits, 0, 0, p.residual)
        return Backbone(p.bits, p.group, p.value_group, p.residual)

    def outlier_counts(self, shape: KVShape, q: int) -> tuple[int, int]:
        """(kK, kV) per side: per K channel over q tokens, per V token over head_dim."""
        if not self.sparse:
            return 0, 0
        pct = self.params.outlier_pct
        return outliers_per_side(q, pct), outliers_per_side(shape.head_dim, pct)

    def rank_of(self, shape: KVShape, q: int) -> int:
        """r of a page with q quantized tokens (0 when q == 0)."""
        if q == 0:
            return 0
        if self.params.lowrank == "sequence":
            q = self.backbone().quantized_tokens(shape.tokens)
        return min(self.params.rank, q, shape.head_dim)

    def extra_fields(self, shape: KVShape, q: int) -> list[Field]:
        h, d = shape.kv_heads, shape.head_dim
        r = self.rank_of(shape, q)
        fields = [Field("lr_a", "f16", (2, h, q, r)), Field("lr_b", "f16", (2, h, d, r))]
        if self.sparse:
            ik = index_kind(self.params.page_tokens)
            iv = index_kind(d)
            if self.exact_outliers:
                pct = self.params.outlier_pct  # sizes only: no tensors
                kshape = (h, 2 * sum(outlier_side_counts(q, d, pct, True)))
                vshape = (h, 2 * sum(outlier_side_counts(d, q, pct, True)))
            else:
                kk, kv = self.outlier_counts(shape, q)
                kshape, vshape = (h, d, 2 * kk), (h, q, 2 * kv)
            # index limits: token within the page's q quantized tokens, channel < head_dim
            fields += [Field("ko_idx", ik, kshape, limit=q), Field("ko_val", "f16", kshape),
                       Field("vo_idx", iv, vshape, limit=d), Field("vo_val", "f16", vshape)]
        return fields

    @property
    def exact_outliers(self) -> bool:
        return self.sparse and self.params.outlier_count == "exact"

    def schedules(self, d: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """'exact': per-side counts of the d K channels (over q tokens) and of the q V tokens
        (over d channels) of one head-page."""
        pct = self.params.outlier_pct
        return outlier_schedule(q, d, pct, True), outlier_schedule(d, q, pct, True)

    def pre_quantize(self, xq: torch.Tensor, shape: KVShape) -> tuple[torch.Tensor, Any]:
        """Remove each page's outliers (gear); state[(layer, t0)] = outlier fields."""
        # (layer, t0) -> outlier fields; post_quantize adds the low-rank fits
        state: dict[Any, Any] = {}
        if not self.sparse:
            return xq, state
        filled = xq.clone()
        pt, tq = self.params.page_tokens, xq.shape[3]
        for t0 in range(0, tq, pt):
            q = min(pt, tq - t0)
            # keys per channel: [layers, heads, d, q]; values per token: [layers, heads, q, d]
            if self.exact_outliers:
                ck, cv = self.schedules(shape.head_dim, q)
                kf, ki, kvals = split_outliers_ragged(xq[:, 0, :, t0:t0 + q].transpose(-1, -2),
                                                      ck)
                vf, vi, vvals = split_outliers_ragged(xq[:, 1, :, t0:t0 + q], cv)
            else:
                kk, kv = self.outlier_counts(shape, q)
                kf, ki, kvals = split_outliers(xq[:, 0, :, t0:t0 + q].transpose(-1, -2), kk)
                vf, vi, vvals = split_outliers(xq[:, 1, :, t0:t0 + q], kv)
            filled[:, 0, :, t0:t0 + q] = kf.transpose(-1, -2)
            filled[:, 1, :, t0:t0 + q] = vf
            for layer in range(xq.shape[0]):
                state[(layer, t0)] = {"ko_idx": ki[layer], "ko_val": kvals[layer],
                                      "vo_idx": vi[layer], "vo_val": vvals[layer]}
        return filled, state

    def fit_error(self, state: Any, layer: int, t0: int, x_page: torch.Tensor,
                  xhat_page: torch.Tensor) -> torch.Tensor:
        """The quantization error of one page [2, heads, q, d], zero on the outlier slots
        (they are overwritten at decode: left out of the low-rank fit)."""
        err = x_page - xhat_page
        if self.exact_outliers:
            out, (q, d) = state[(layer, t0)], err.shape[2:]
            ck, cv = self.schedules(d, q)
            err = err.clone()
            err[0] = scatter_ragged(err[0].transpose(-1, -2), out["ko_idx"], ragged_vectors(ck),
                                    0.0).transpose(-1, -2)
            err[1] = scatter_ragged(err[1], out["vo_idx"], ragged_vectors(cv), 0.0)
        elif self.sparse:
            out = state[(layer, t0)]
            err = err.clone()
            ek = err[0].transpose(-1, -2)  # [heads, d, q] view
            ek.scatter_(-1, out["ko_idx"], 0.0)
            err[1].scatter_(-1, out["vo_idx"], 0.0)
        return err

    def post_quantize(self, state: Any, xq: torch.Tensor, xhat: torch.Tensor | None) -> Any:
        """The low-rank fits of the quantization error, made here for the whole cache:
        lowrank 'sequence': A [Tq, r], B [d, r] per (layer, K|V, head) over all quantized
        tokens, state["lowrank"] = (A [layers, 2, heads, Tq, r], B [.., d, r]);
        lowrank 'page': A [q, r], B [d, r] per (layer, K|V, head, page), state[("lowrank",
        layer, t0)] = (A [2, heads, q, r], B [2, heads, d, r]), every page of the same q
        fitted in one low_rank call. low_rank works row by row (elementwise ops over the
        batch), so a batch gives each page the bits its own call would; one call per page
        length instead of one per page keeps a GPU busy (per page, its thousands of small
        launches take 13 s for a 64 MB cache on an H100)."""
        tq = xq.shape[3]
        if tq == 0 or xhat is None:
            return state
        layers, _, h, _, d = xq.shape
        p = self.params
        pt = p.page_tokens
        err = torch.empty_like(xq)  # [layers, 2, h, Tq, d]
        for layer in range(layers):
            for t0 in range(0, tq, pt):
                sl = (layer, slice(None), slice(None), slice(t0, t0 + pt))
                err[sl] = self.fit_error(state, layer, t0, xq[sl], xhat[sl])
        if p.lowrank == "sequence":
            a, b = fit_fp16(*low_rank(err.reshape(layers * 2 * h, tq, d), p.rank, p.iters,
                                      p.seed))
            state["lowrank"] = (a.reshape(layers, 2, h, tq, -1), b.reshape(layers, 2, h, d, -1))
            return state
        full = tq // pt * pt  # the full pages, then the last one if it is shorter
        for t_lo, t_hi, q in ((0, full, pt), (full, tq, tq - full)):
            n = (t_hi - t_lo) // q if q else 0  # pages of length q
            if n == 0:
                continue
            e = err[:, :, :, t_lo:t_hi].reshape(layers * 2 * h * n, q, d)  # rows (l, kv, h, page)
            a, b = fit_fp16(*low_rank(e, p.rank, p.iters, p.seed))
            a, b = a.reshape(layers, 2, h, n, q, -1), b.reshape(layers, 2, h, n, d, -1)
            for layer in range(layers):
                for i in range(n):
                    state[("lowrank", layer, t_lo + i * q)] = (a[layer, :, :, i],
                                                               b[layer, :, :, i])
        return state

    def page_extras(self, state: Any, layer: int, t0: int, q: int, x_page: torch.Tensor,
                    xhat_page: torch.Tensor) -> dict[str, torch.Tensor]:
        if q == 0:
            return {}
        out: dict[str, torch.Tensor] = dict(state[(layer, t0)]) if self.sparse else {}
        if self.params.lowrank == "sequence":
            a, b = state["lowrank"]
            out["lr_a"], out["lr_b"] = a[layer, :, :, t0:t0 + q], b[layer]
        else:
            out["lr_a"], out["lr_b"] = state[("lowrank", layer, t0)]
        return out

    # ---- the device path: outliers, fits and fields batched over runs of pages ---------
    def has_device_path(self, device: torch.device, shape: KVShape) -> bool:
        """Per-page fits and 'ceil' outliers (the 'sequence' fits and 'exact' counts run the
        torch reference on the device) on a shape the backbone's kernels pack."""
        return (self.params.lowrank == "page" and not self.exact_outliers
                and super().has_device_path(device, shape))

    def _encode_device(self, kv: torch.Tensor, shape: KVShape
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The wire buffer of kv (one stream) and the input's check status (DeviceWire):
        1. every page's outliers picked and their slots filled (pre_quantize's ops, batched
           over a run of pages: page_runs gives the full pages, then at most one shorter);
        2. the backbone's Triton kernels quantize the filled cache into the buffer (kcvt: its
           keys' stats first); torch copies the bf16 window;
        3. the same kernels dequantize the buffer (the reference's dequantization, op for
           op), and the error, zero on the outlier slots, is fitted by the Triton twin of
           low_rank (lowrank_triton, the same bits) and fit_fp16, one launch per run;
        4. lr_a, lr_b, ko_* and vo_* written through strided views of the buffer, one copy
           per field and run.
        A fixed number of launches, whatever the pages."""
        from kvsim.kernels.kivi.lowrank_triton import low_rank_device

        p = self.params
        status, geo, _, layer_bytes, buf = self._device_wire(kv, shape)
        layers = shape.layers
        x = kv.detach().to(torch.float32, copy=True)  # outlier slots filled in place
        runs = page_runs(geo)
        ik, iv = index_kind(p.page_tokens), index_kind(shape.head_dim)
        slots: list[tuple[torch.Tensor, torch.Tensor]] = []  # each run's outlier indices
        for run in runs if self.sparse else []:
            page = run_tokens(x, run)  # [L, 2, H, n, q, D]
            kk, kvn = self.outlier_counts(shape, run.q)
            # keys per channel over the page's tokens, values per token over head_dim
            kf, ki, kval = split_outliers(page[:, 0].transpose(-1, -2), kk)  # [L, H, n, D, .]
            vf, vi, vval = split_outliers(page[:, 1], kvn)  # [L, H, n, q, .]
            page[:, 0] = kf.transpose(-1, -2)
            page[:, 1] = vf
            write_field(buf, geo, run, G_KOI, layer_bytes, chunk_major(stored_index(ki, ik), 2))
            write_field(buf, geo, run, G_KOV, layer_bytes, chunk_major(kval.to(torch.float16), 2))
            write_field(buf, geo, run, G_VOI, layer_bytes, chunk_major(stored_index(vi, iv), 2))
            write_field(buf, geo, run, G_VOV, layer_bytes, chunk_major(vval.to(torch.float16), 2))
            slots.append((ki, vi))
        self._backbone_kernels(x, buf, shape, decode=False)
        self._window_copy(buf, x, geo, layer_bytes, True)  # past the quantized tokens: as given
        if not runs:
            return [buf], status
        xhat = torch.empty(shape.dims, dtype=torch.float32, device=buf.device)
        self._backbone_kernels(xhat, buf, shape, decode=True)  # the window's tokens: unused
        for i, run in enumerate(runs):
            err = run_tokens(x, run) - run_tokens(xhat, run)  # [L, 2, H, n, q, D]
            if self.sparse:  # zero on the outlier slots (written back at decode)
                ki, vi = slots[i]
                err[:, 0].transpose(-1, -2).scatter_(-1, ki, 0.0)
                err[:, 1].scatter_(-1, vi, 0.0)
            start = self._device_start(shape.head_dim, self.rank_of(shape, run.q), buf.device)
            a, b = fit_fp16(*low_rank_device(err.reshape(-1, run.q, shape.head_dim), p.rank,
                                             p.iters, start))  # rows (layer, K|V, head, page)
            a = a.reshape(layers, 2, shape.kv_heads, run.count, run.q, -1)
            b = b.reshape(layers, 2, shape.kv_heads, run.count, shape.head_dim, -1)
            write_field(buf, geo, run, G_LA, layer_bytes, chunk_major(a.to(torch.float16), 3))
            write_field(buf, geo, run, G_LB, layer_bytes, chunk_major(b.to(torch.float16), 3))
        return [buf], status

    def _device_start(self, d: int, r: int, device: torch.device) -> torch.Tensor:
        """low_rank_start(d, r, seed) on `device`, copied there once (a copy from the host
        in every encode would wait for the device's queue)."""
        starts = self.__dict__.setdefault("_device_starts", {})
        key = (d, r, str(device))
        if key not in starts:
            starts[key] = low_rank_start(d, r, self.params.seed).to(device)
        return starts[key]

    def _decode_device(self, buffers: list[torch.Tensor], shape: KVShape,
                       dtype: torch.dtype) -> torch.Tensor:
        """Mirror of _encode_device: fp32 (decode_device casts) [layers, 2, kv_heads, tokens,
        head_dim] from the wire buffer."""
        p, buf = self.params, buffers[0]
        layers, h, d = shape.layers, shape.kv_heads, shape.head_dim
        out = torch.empty(shape.dims, dtype=torch.float32, device=buf.device)
        geo, _, layer_bytes = self._device_geometry(shape, buf.device)
        self._backbone_kernels(out, buf, shape, decode=True)
        self._window_copy(buf, out, geo, layer_bytes, False)
        ik, iv = index_kind(p.page_tokens), index_kind(d)
        for run in page_runs(geo):
            q, r = run.q, self.rank_of(shape, run.q)
            a = read_field(buf, geo, run, G_LA, layer_bytes, layers, torch.float16, (2, h, q, r))
            b = read_field(buf, geo, run, G_LB, layer_bytes, layers, torch.float16, (2, h, d, r))
            view = chunk_major(run_tokens(out, run), 3)  # [L, n, 2, H, q, D], a view into out
            x = view + low_rank_product(a.to(torch.float32), b.to(torch.float32))
            if self.sparse:
                kk, kvn = self.outlier_counts(shape, q)
                fields = []  # (indices int64, values) of K, then V: [L, n, H, vectors, 2k]
                for col_idx, col_val, kind, k, n in ((G_KOI, G_KOV, ik, kk, d),
                                                     (G_VOI, G_VOV, iv, kvn, q)):
                    idx = read_field(buf, geo, run, col_idx, layer_bytes, layers,
                                     index_dtype(kind), (h, n, 2 * k))
                    fields += [loaded_index(idx, kind),
                               read_field(buf, geo, run, col_val, layer_bytes, layers,
                                          torch.float16, (h, n, 2 * k))]
                restore_outliers(x, *fields)
            view.copy_(x)
        return out

    # ---- fused CPU path (kivi_cpu): outliers, backbone and error in numba, fits in torch --
    def fused_ok(self, shape: KVShape) -> bool:
        """The fused kernels cover 'ceil' outliers and per-page fits (else the generic path)."""
        return self.params.lowrank == "page" and not self.exact_outliers

    def index_bytes(self, shape: KVShape) -> tuple[int, int]:
        return (1 if index_kind(self.params.page_tokens) == "u8" else 2,
                1 if index_kind(shape.head_dim) == "u8" else 2)

    def fused_prepare(self, x: torch.Tensor, shape: KVShape, geo: np.ndarray, layer_bytes: int,
                      out: np.ndarray) -> FusedInput:
        """Outliers picked by the encode kernel (kcvt backbone: beforehand, ko_* / vo_*
        fields written), and the buffers of the per-page low-rank fits the encode kernel
        makes (kivi_cpu._low_rank)."""
        inp = FusedInput()
        if self.sparse and self.params.backbone == "kcvt":
            # kcvt's key groups span all pages: fill the outlier slots of the whole cache
            # first (the kernel then quantizes the filled copy)
            tq = int(geo[:, G_QK].sum())
            filled, inp.peak = kivi_cpu.split_outliers_fused(
                kivi_cpu.Source.of(x), geo, layer_bytes, shape.dims, tq,
                self.index_bytes(shape), out)
            inp.src_k = inp.src_v = kivi_cpu.Source.of(filled)
        else:
            inp.select_outliers = self.sparse
        p, d = self.params, shape.head_dim
        start = [low_rank_start(d, int(r), p.seed).numpy() for r in geo[:, G_RANK]]
        inp.lowrank = kivi_cpu.LowRankOut.empty(geo, shape.layers, shape.kv_heads, d, p.iters,
                                                start)
        return inp

    def fused_finish(self, inp: FusedInput, shape: KVShape, geo: np.ndarray, layer_bytes: int,
                     out: np.ndarray) -> None:
        """lr_a / lr_b of every page: the kernel's fits through fit_fp16, as fp16."""
        h, d, lr = shape.kv_heads, shape.head_dim, inp.lowrank
        assert lr is not None
        for layer in range(shape.layers):
            for page in range(geo.shape[0]):
                q, r = int(geo[page, G_QK]), int(geo[page, G_RANK])
                if q == 0:
                    continue
                ao, bo = int(lr.aoff[layer, page]), int(lr.boff[layer, page])
                a, b = fit_fp16(torch.from_numpy(lr.a[ao:ao + 2 * h * q * r]).view(2 * h, q, r),
                                torch.from_numpy(lr.b[bo:bo + 2 * h * d * r]).view(2 * h, d, r))
                base = layer * layer_bytes + int(geo[page, G_BASE])
                for col, t in ((G_LA, a), (G_LB, b)):
                    raw = t.to(torch.float16).contiguous().view(torch.int16).numpy()
                    o = base + int(geo[page, col])
                    out[o:o + raw.nbytes] = raw.reshape(-1).view(np.uint8)

    def post_dequantize(self, f: dict[str, torch.Tensor], xhat_page: torch.Tensor
                        ) -> torch.Tensor:
        # lr_a [2, heads, q, r], lr_b [2, heads, d, r]
        x = xhat_page + low_rank_product(f["lr_a"].to(torch.float32),
                                         f["lr_b"].to(torch.float32))
        if self.exact_outliers:
            ck, cv = self.schedules(x.shape[3], x.shape[2])
            x[0] = scatter_ragged(x[0].transpose(-1, -2), f["ko_idx"], ragged_vectors(ck),
                                  f["ko_val"]).transpose(-1, -2)
            x[1] = scatter_ragged(x[1], f["vo_idx"], ragged_vectors(cv), f["vo_val"])
        elif self.sparse:
            restore_outliers(x, f["ko_idx"].long(), f["ko_val"], f["vo_idx"].long(),
                             f["vo_val"])
        return x


@register
class GearLCodec(GearCodec):
    """GEAR-L: backbone + low rank, no outlier matrix."""

    name = "gear-l"
    sparse = False
