"""The timing model both engines use: prefill, decode-step and verification times of one
model on one hardware preset, from the roofline or from a measured hardware profile
(kvsim.model.hardware_profile).

prefill_s(tokens)          = max(FLOPs / (peak * prefill_mfu), weight bytes / (HBM * mbu))
tpot_s(context, batch)     = max((weights read + batch * KV bytes) / (HBM * decode_mbu),
                                 batch * FLOPs per token / (peak * prefill_mfu)) + step_overhead_s
verify_s(drafted, context) = one forward over the drafted tokens (same roofline)
batch_step_s(...)          = one step of a continuous batch of mixed members (the same
                             roofline over the members' summed new tokens, FLOPs, KV reads)

`devices` is the tensor-parallel degree of one prefill or decode instance: peak FLOP/s and
HBM bandwidth scale with it (times `tp_efficiency`). A measured profile overrides the
roofline for its model, by piecewise-linear interpolation; batch and drafted-token curves
measured at one context are applied as ratios to the batch-1 TPOT at other contexts; without
them the roofline's ratio is used.
"""


from __future__ import annotations

import math

import numpy as np

from kvsim.model.hardware import HardwareSpec
from kvsim.model.hardware_profile import BESIDE_ENTRIES, load_profile
from kvsim.model.spec import ModelSpec


def _measured_batch_ratio(batch: int, sizes: list[int], step_s: list[float]) -> float:
    """A batch-`batch` step over a lone step from steps measured at batch `sizes`,
    interpolated between them and held beyond the largest (the timing-model emulator's
    batch steps by the same ratio, so the shipped multi-request runs were measured so)."""
    return float(np.interp(batch, sizes, step_s) / np.interp(1, sizes, step_s))


class TimingModel:
    """Prefill / decode-step / verification times of one model on one hardware preset."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec,
                 draft_step: dict | None = None) -> None:
        """draft_step: a `draft_step` entry measured on the link in use (a link profile's,
        checked by check_draft_step, as kvsim.scenario.link_profile.draft_step_for accepts it),
        which replaces the hardware profile's whole entry (its busy_ratio too, present or
        not): a draft step's slowdown beside the receiver's work depends on what the link
        costs the host too."""
        self.model, self.hw = model, hw
        self._profile = load_profile(hw.profile, model.name) if hw.profile else None
        self._draft_step = draft_step if draft_step is not None else \
            (self._profile.get("draft_step") if self._profile else None)
        self._tpot_cache: dict[tuple[int, int], float] = {}
        self._beside_cache: dict[int, float] = {}  # members -> beside_prefill_ratio
        self._step_rates: tuple[float, float] | None = None
        self._weight_read_bytes: dict[int, float] = {}  # new tokens -> weights a step reads
        # (new tokens, context) -> member_work, shared by every decode batch of a run
        self._member_work: dict[tuple[int, int], tuple[float, float]] = {}

    def check_fits(self, context_tokens: int) -> None:
        """Weights + one bf16 cache of `context_tokens` must fit the instance's memory; the
        error names the override that fixes it (the smallest hardware.devices that fits)."""
        need = self.model.weight_bytes + self.model.kv_bytes_bf16(context_tokens)
        per_device = self.hw.memory_gb * 1e9
        have = per_device * self.hw.devices
        if need > have:
            devices = math.ceil(need / per_device)
            raise ValueError(
                f"{self.model.name} with a {context_tokens}-token bf16 KV cache needs "
                f"{need / 1e9:.1f} GB but {self.hw.devices} x {self.hw.name} has "
                f"{have / 1e9:.1f} GB; raise hardware.devices (hardware.devices={devices} "
                f"fits), or pick a smaller model= / shorter workload.context_tokens")

    def _forward_s(self, new_tokens: int, context_tokens: int, batch: int,
                   compute_eff: float, mem_eff: float) -> float:
        m, hw = self.model, self.hw
        flops = batch * m.forward_flops(new_tokens, context_tokens)
        read = m.weight_read_bytes(batch * new_tokens) + \
            batch * m.kv_bytes_bf16(context_tokens + new_tokens)
        return max(flops / (hw.flops_per_s * compute_eff), read / (hw.hbm_bytes_per_s * mem_eff))

    def prefill_s(self, tokens: int) -> float:
        if self._profile is not None:
            p = self._profile["prefill"]
            return float(np.interp(tokens, p["tokens"], p["s"]))
        return self._forward_s(tokens, 0, 1, self.hw.prefill_mfu, self.hw.decode_mbu) + \
            self.hw.step_overhead_s

    def prefill_step_s(self, parts: list[tuple[int, int]]) -> float:
        """One chunked prefill step over `parts` [(n new tokens of a prompt, c tokens of the
        same prompt prefilled before them)]: the roofline over their summed FLOPs (n queries
        over c + n keys) and reads (weights once, each part's KV of c + n tokens). One part
        (n, 0) is prefill_s(n). A profile scales its measured prefill of the step's tokens
        by the roofline's ratio to a fresh prompt of that many tokens."""
        m, hw = self.model, self.hw
        new = sum(n for n, _ in parts)
        flops = sum(m.forward_flops(n, c) for n, c in parts)
        read = m.weight_read_bytes(new) + sum(m.kv_bytes_bf16(c + n) for n, c in parts)
        roof = max(flops / (hw.flops_per_s * hw.prefill_mfu),
                   read / (hw.hbm_bytes_per_s * hw.decode_mbu))
        if self._profile is not None:
            return self.prefill_s(new) * roof / self._forward_s(new, 0, 1, hw.prefill_mfu,
                                                                hw.decode_mbu)
        return roof + hw.step_overhead_s

    def tpot_s(self, context_tokens: int, batch: int = 1) -> float:
        key = (int(context_tokens), int(batch))
        hit = self._tpot_cache.get(key)
        if hit is not None:
            return hit
        roof = self._forward_s(1, context_tokens, batch, self.hw.prefill_mfu, self.hw.decode_mbu)
        if self._profile is not None:
            p = self._profile["tpot"]
            base = float(np.interp(context_tokens, p["context_tokens"], p["s"]))
            value = base * self._batch_ratio(int(batch), roof, int(context_tokens))
        else:
            value = roof + self.hw.step_overhead_s
        self._tpot_cache[key] = value
        return value

    def _batch_ratio(self, batch: int, roof: float, context_tokens: int) -> float:
        """A batch-B step over a batch-1 step: the profile's measured curve when it has
        one of two sizes or more (measured at several contexts: the ratio interpolated
        between them, held beyond), else the roofline's ratio (roof: the batch-B roofline
        at this context)."""
        curve = self._profile.get("tpot_batch") if self._profile else None
        if curve and len(curve["batch"]) > 1:  # (a lone step's curve gives no ratio)
            at, sizes = curve["context_tokens"], curve["batch"]
            if isinstance(at, list):
                ratios = [_measured_batch_ratio(batch, sizes, s_c) for s_c in curve["s"]]
                return float(np.interp(context_tokens, at, ratios))
            return _measured_batch_ratio(batch, sizes, curve["s"])
        return roof / self._forward_s(1, context_tokens, 1, self.hw.prefill_mfu,
                                      self.hw.decode_mbu)

    @property
    def beside_prefill_measured(self) -> bool:
        """The profile measured a decode step beside a live prefill (`tpot_beside_prefill`)."""
        return bool(self._profile and self._profile.get("tpot_beside_prefill"))

    def beside_prefill_ratio(self, batch: int) -> float:
        """A decode step of `batch` members while a prefill runs on the same host, over the
        same step alone: the profile's `tpot_beside_prefill` (kvsim.calibrate.beside_prefill),
        interpolated between its batch sizes and held beyond them. For
        workload.colocated_prefill, which needs it measured. Memoized: a decode batch asks
        at every change while a prefill runs."""
        hit = self._beside_cache.get(batch)
        if hit is None:
            curve = self._beside_entry("tpot_beside_prefill")
            hit = self._beside_cache[batch] = float(np.interp(batch, curve["batch"],
                                                              curve["ratio"]))
        return hit

    def beside_worker_extra_s(self) -> float:
        """What a decode step costs beyond itself while an on-arrival worker dequantizes on
        the same host (s, whatever the batch: kvsim.calibrate.beside_worker): the profile's
        `tpot_beside_worker.extra_s`. For workload.worker_slows_decode, which needs it
        measured."""
        return float(self._beside_entry("tpot_beside_worker")["extra_s"])

    def _beside_entry(self, key: str) -> dict:
        """The profile's `key` entry; refused, with the calibration that measures it, where
        the profile has none."""
        entry = self._profile.get(key) if self._profile else None
        if not entry:
            beside, _, setting = BESIDE_ENTRIES[key]
            raise ValueError(
                f"a decode step beside {beside} was not measured for {self.model.name} on "
                f"{self.hw.name} (the hardware profile has no {key}: `kvsim calibrate "
                f"{setting}`)")
        return entry

    def first_step_extra_s(self, context_tokens: int) -> float:
        """What the first decode step on a freshly built cache costs beyond a later step
        (s; measured profiles only: the roofline has no such term)."""
        curve = self._profile.get("first_step_extra") if self._profile else None
        if not curve:
            return 0.0
        return float(np.interp(context_tokens, curve["context_tokens"], curve["s"]))

    def cache_build_s(self, context_tokens: int) -> float:
        """Building the decoder's cache from already dequantized layers (s; measured
        profiles with `cache_build` only, else 0)."""
        build = self._profile.get("cache_build") if self._profile else None
        if not build:
            return 0.0
        return float(self.model.kv_bytes_bf16(context_tokens)) / (build["gb_per_s"] * 1e9)

    def draft_contention_s(self, context_tokens: int) -> float:
        """What a draft step costs beyond a decode step when the receiver dequantizes the
        later streams beside it (s): (draft_step.ratio - 1) x TPOT at this context, from a
        profile that measured it (`kvsim calibrate`'s transfer); 0 without one."""
        extra = self._draft_step_extra_s("ratio", context_tokens)
        return 0.0 if extra is None else extra

    def draft_busy_contention_s(self, context_tokens: int) -> float | None:
        """What a draft step costs beyond a decode step while the receiver's on-arrival
        worker dequantizes beside it, or the receiver is otherwise fully busy (taking the
        later streams in: draft_ingest_s_per_byte) (s): (draft_step.busy_ratio - 1) x TPOT
        at this context;
        None when the profile did not measure it (kvsim.calibrate.receiver_timing:
        draft_busy_ratio, from the worker's layer spans)."""
        return self._draft_step_extra_s("busy_ratio", context_tokens)

    def draft_ingest_s_per_byte(self) -> float:
        """The receiver's busy time per later-stream byte it takes in while a request drafts
        (s/B; draft_step.ingest_s_per_byte, fitted by kvsim.calibrate.draft_ingest): it adds
        to the on-arrival worker's load in the busy share of the draft step (0 where not
        measured: the worker's jobs alone)."""
        draft = self._draft_step
        return float(draft.get("ingest_s_per_byte", 0.0)) if draft else 0.0

    def _draft_step_extra_s(self, field: str, context_tokens: int) -> float | None:
        """(draft_step.<field> - 1) x TPOT at this context (s); None where not measured."""
        draft = self._draft_step
        if not draft or field not in draft:
            return None
        return (float(draft[field]) - 1.0) * self.tpot_s(context_tokens)

    def member_work(self, new_tokens: int, context_tokens: int) -> tuple[float, float]:
        """One sequence's share of a batched forward step over `new_tokens` new tokens
        (1 decoding, n verifying n drafts) attending to its `context_tokens`: (FLOPs, bf16
        KV bytes read). Summed over the batch, they give `batch_step_s`. Memoized: a
        decode batch asks at every join and phase change."""
        key = (new_tokens, context_tokens)
        work = self._member_work.get(key)
        if work is None:
            work = self._member_work[key] = (
                self.model.forward_flops(new_tokens, context_tokens),
                float(self.model.kv_bytes_bf16(context_tokens + new_tokens)))
        return work

    def batch_step_s(self, new_tokens: int, flops: float, kv_read_bytes: float,
                     sequences: int, context_tokens_sum: float) -> float:
        """One forward step of a continuous batch: `sequences` members with `new_tokens`
        new tokens between them, their summed FLOPs and KV bytes read (`member_work`); the
        weights are read once per step (MoE: once per active-expert set, see
        ModelSpec.weight_read_bytes). A batch of B members of one context c gives
        tpot_s(c, B); one member verifying n drafts alone gives verify_s(n, c). A profile
        scales its measured TPOT at the members' mean context by the roofline's ratio."""
        hw = self.hw
        if self._step_rates is None:  # FLOP/s and bytes/s a step reaches (hw is fixed)
            self._step_rates = (hw.flops_per_s * hw.prefill_mfu, hw.hbm_bytes_per_s * hw.decode_mbu)
        flop_rate, byte_rate = self._step_rates
        weight_bytes = self._weight_read_bytes.get(new_tokens)
        if weight_bytes is None:  # depends on new_tokens only (the model is fixed): once each
            weight_bytes = self._weight_read_bytes[new_tokens] = \
                self.model.weight_read_bytes(new_tokens)
        roof = max(flops / flop_rate, (weight_bytes + kv_read_bytes) / byte_rate)
        if self._profile is None:
            return roof + hw.step_overhead_s
        mean_ctx = round(context_tokens_sum / sequences)
        if self._profile.get("tpot_batch") and new_tokens == sequences:  # plain decode steps
            return self.tpot_s(mean_ctx, sequences)
        one = self._forward_s(1, mean_ctx, 1, hw.prefill_mfu, hw.decode_mbu)
        return self.tpot_s(mean_ctx) * roof / one

    def batch_pass_s(self, new_tokens: int, flops: float, kv_read_bytes: float,
                     sequences: int, context_tokens_sum: float, verifying: int) -> float:
        """One step of a continuous batch (`batch_step_s`), except a lone verification pass
        (one member, verifying) where the profile measured it: that pass's own curve (the
        roofline's ratio to a decode step misses a fresh cache's first pass over n + 1
        tokens). The simulator's fluid batch and the emulator's stepped batch both time
        their steps with it."""
        if sequences == verifying == 1 and self.verify_measured:
            return self.verify_s(new_tokens, int(context_tokens_sum))
        return self.batch_step_s(new_tokens, flops, kv_read_bytes, sequences,
                                 context_tokens_sum)

    @property
    def verify_measured(self) -> bool:
        """A measured profile holds the verification pass's own curve."""
        return bool(self._profile and self._profile.get("verify"))

    def verify_s(self, drafted_tokens: int, context_tokens: int) -> float:
        """One forward over the drafted tokens on the full cache (scores all of them and
        yields the correction / bonus token)."""
        if drafted_tokens <= 0:
            return 0.0
        curve = self._profile.get("verify") if self._profile is not None else None
        if curve:  # measured: its ratio to the TPOT where it was measured, scaled
            drafted = curve["drafted_tokens"]
            at = curve["context_tokens"]
            if isinstance(at, list):  # at several contexts: the ratio interpolated between
                ratios = [float(np.interp(drafted_tokens, drafted, s_c)) / self.tpot_s(int(c))
                          for c, s_c in zip(at, curve["s"], strict=True)]
                ratio = float(np.interp(context_tokens, at, ratios))
            else:
                ratio = float(np.interp(drafted_tokens, drafted, curve["s"])) / \
                    self.tpot_s(int(at))
            return self.tpot_s(context_tokens) * ratio
        if self._profile is not None:  # profile TPOT scaled by the roofline's ratio
            one = self._forward_s(1, context_tokens, 1, self.hw.prefill_mfu, self.hw.decode_mbu)
            many = self._forward_s(drafted_tokens, context_tokens, 1, self.hw.prefill_mfu,
                                   self.hw.decode_mbu)
            return self.tpot_s(context_tokens) * many / one
        return self._forward_s(drafted_tokens, context_tokens, 1, self.hw.prefill_mfu,
                               self.hw.decode_mbu) + self.hw.step_overhead_s
