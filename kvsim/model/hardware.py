"""Hardware presets (conf/hardware/<name>.yaml) and the roofline timing model.

prefill_s(tokens)          = max(FLOPs / (peak * prefill_mfu), weight bytes / (HBM * mbu))
tpot_s(context, batch)     = max((weights read + batch * KV bytes) / (HBM * decode_mbu),
                                 batch * FLOPs per token / (peak * prefill_mfu)) + step_overhead_s
verify_s(drafted, context) = one forward over the drafted tokens (same roofline)
batch_step_s(...)          = one step of a continuous batch of mixed members (the same
                             roofline over the members' summed new tokens, FLOPs, KV reads)

`devices` is the tensor-parallel degree of one prefill or decode instance: peak FLOP/s and
HBM bandwidth scale with it (times `tp_efficiency`). A measured profile (JSON; `profile:` a
path or the name of a shipped one, kvsim.core.profiles; `kvsim calibrate` writes them) overrides
the roofline for its model:
  {"model": "<model name>", "prefill": {"tokens": [...], "s": [...]},
   "tpot": {"context_tokens": [...], "s": [...]}, "source": "..."}
and optionally (written by `kvsim calibrate`)
  "tpot_batch": {"context_tokens": c, "batch": [...], "s": [...]}    decode step vs batch
  "verify": {"context_tokens": c, "drafted_tokens": [...], "s": [...]}  verification pass
      (or "context_tokens": [c1, ...] and "s": [[...], ...]: measured at several contexts,
      its ratio to the TPOT there interpolated between them)
  "first_step_extra": {"context_tokens": [...], "s": [...]}   first step on a fresh cache
  "cache_build": {"gb_per_s": x}    building the model's cache from dequantized layers (GB/s
                                    of bf16 cache; deserializer=on_arrival, where it is the
                                    only load left once the last layer is dequantized)
  "draft_step": {"ratio": r}        a draft step over a decode step while the receiver
                                    dequantizes the later streams beside it (>= 1; the
                                    drafting overhead of deserializer=on_arrival), averaged
                                    over the drafting; optional "busy_ratio": the same
                                    while the on-arrival worker is busy (>= 1; used, with
                                    the worker's load, where present); optional
                                    "ingest_s_per_byte": the receiver's busy time per
                                    later-stream byte taken in (s/B, in [0, 1e-3]; adds
                                    to that load, with busy_ratio only:
                                    kvsim.calibrate.draft_ingest); a link
                                    profile's own draft_step (measured on that link)
                                    replaces the whole entry in a run with that
                                    link.profile (kvsim.scenario.link_profile.draft_step_for)
Piecewise-linear interpolation; batch and drafted-token curves measured at one context are
applied as ratios to the batch-1 TPOT at other contexts; without them the roofline's ratio
is used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import MISSING

from kvsim.core.checks import check_number
from kvsim.core.data_files import record_loaded
from kvsim.model.spec import ModelSpec


@dataclass
class HardwareSpec:
    name: str = MISSING
    hbm_gb_per_s: float = MISSING  # per device, GB/s (1e9 bytes/s)
    bf16_tflops: float = MISSING  # per device, dense bf16 peak, 1e12 FLOP/s
    memory_gb: float = MISSING  # per device, GB of accelerator memory
    devices: int = 1  # tensor-parallel degree of one instance
    tp_efficiency: float = 1.0  # fraction of linear scaling kept with `devices`
    prefill_mfu: float = 0.5  # fraction of peak FLOP/s a prefill reaches
    decode_mbu: float = 0.7  # fraction of HBM bandwidth a decode step reaches
    step_overhead_s: float = 0.0  # fixed cost per forward step (launches, sampling, sync)
    source: str = ""  # where the numbers come from
    profile: str = ""  # optional measured profile JSON overriding the roofline

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Finite, positive numbers (fields still MISSING while Hydra builds the schema are
        skipped: they are checked again when the composed config is validated)."""
        for key in ("hbm_gb_per_s", "bf16_tflops", "memory_gb", "prefill_mfu", "decode_mbu",
                    "tp_efficiency"):
            value = getattr(self, key)
            if isinstance(value, (int, float)):
                check_number(f"hardware {self.name}: {key}", value)
        for key in ("prefill_mfu", "decode_mbu", "tp_efficiency"):
            value = getattr(self, key)
            if isinstance(value, (int, float)) and value > 1:
                raise ValueError(f"hardware {self.name}: {key} is a fraction <= 1, got {value}")
        if isinstance(self.devices, int) and self.devices < 1:
            raise ValueError(f"hardware {self.name}: devices must be >= 1, got {self.devices}")
        if isinstance(self.step_overhead_s, (int, float)):
            check_number(f"hardware {self.name}: step_overhead_s", self.step_overhead_s,
                         strict=False)

    @property
    def scale(self) -> float:
        return self.devices * (self.tp_efficiency if self.devices > 1 else 1.0)

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gb_per_s * 1e9 * self.scale

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12 * self.scale


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
        one, else the roofline's ratio (roof: the batch-B roofline at this context)."""
        curve = self._profile.get("tpot_batch") if self._profile else None
        if curve:
            return float(np.interp(batch, curve["batch"], curve["s"]) /
                         np.interp(1, curve["batch"], curve["s"]))
        return roof / self._forward_s(1, context_tokens, 1, self.hw.prefill_mfu,
                                      self.hw.decode_mbu)

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


def scaled_curve(curve: dict, factor: float | Callable[[float], float]) -> dict:
    """A profile curve with its times ("s": a list, or one list per context) x factor: a
    number, or a function of the context (tokens) the times were measured at (the curve's
    "context_tokens": one per point of a context curve, one per row of a verification
    curve measured at several contexts, or the one context of the whole curve)."""
    s = curve["s"]
    if not callable(factor):
        return {**curve, "s": [[v * factor for v in row] if isinstance(row, list)
                               else row * factor for row in s]}
    at = curve["context_tokens"]
    if not isinstance(at, list):  # measured at one context: one factor for the curve
        return scaled_curve(curve, factor(float(at)))
    if len(at) != len(s):
        raise ValueError(f"a curve over contexts needs one time (or row) per context, got "
                         f"{len(at)} contexts and {len(s)} rows")
    return {**curve, "s": [[v * factor(float(c)) for v in row] if isinstance(row, list)
                           else row * factor(float(c)) for c, row in zip(at, s, strict=True)]}


def _check_verify(path: Path, doc: dict) -> None:
    """verify: measured at one context (context_tokens a number, s a list over
    drafted_tokens) or at several (context_tokens an increasing list, s one such list per
    context)."""
    curve = doc["verify"]
    at = curve.get("context_tokens") if isinstance(curve, dict) else None
    if not isinstance(at, list):
        _check_curve(path, doc, "verify", "drafted_tokens", "context_tokens")
        return
    rows = curve.get("s")
    if not at or not isinstance(rows, list) or len(rows) != len(at):
        raise ValueError(f"hardware profile {path}: verify.s needs one list per context of "
                         f"verify.context_tokens")
    # the contexts alone: numbers, increasing (as a curve's x with placeholder times)
    _check_curve(path, {"verify": {"context_tokens": at, "s": [1.0] * len(at)}}, "verify",
                 "context_tokens")
    if min(at) <= 0:
        raise ValueError(f"hardware profile {path}: verify.context_tokens must be > 0")
    for c, row in zip(at, rows, strict=True):
        _check_curve(path, {f"verify at {c}": {"drafted_tokens": curve.get("drafted_tokens"),
                                               "s": row}}, f"verify at {c}", "drafted_tokens")


def _check_curve(path: Path, doc: dict, key: str, xs: str, scalar_x: str = "") -> None:
    """doc[key] holds equal-length lists xs and s of finite numbers (s > 0 unless extra),
    xs increasing; scalar_x (optional): a positive number the curve was measured at."""
    curve = doc.get(key)
    if not isinstance(curve, dict) or not isinstance(curve.get(xs), list) or \
            not isinstance(curve.get("s"), list):
        raise ValueError(f"hardware profile {path}: needs {key}.{xs} and {key}.s (lists)")
    x, s = curve[xs], curve["s"]
    if len(x) != len(s) or len(s) < 1:
        raise ValueError(f"hardware profile {path}: {key} lists differ in length or are empty")
    values = [*x, *s] + ([curve.get(scalar_x)] if scalar_x else [])
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in values):
        raise ValueError(f"hardware profile {path}: {key} holds a non-finite or non-number")
    if any(b <= a for a, b in zip(x, x[1:], strict=False)):
        raise ValueError(f"hardware profile {path}: {key}.{xs} must increase")
    floor_ok = min(s) >= 0 if key == "first_step_extra" else min(s) > 0
    if not floor_ok:
        raise ValueError(f"hardware profile {path}: {key}.s must be > 0 s (extra: >= 0)")


def load_profile(name_or_path: str, model_name: str) -> dict:
    """A measured hardware profile (a path, or a shipped profile's name), checked."""
    from kvsim.core.profiles import profile_path

    p = profile_path("hardware", name_or_path)
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"hardware profile {p}: not JSON ({exc})") from None
    record_loaded(p)
    if doc.get("model") != model_name:
        raise ValueError(f"hardware profile {p} is for model {doc.get('model')!r}, "
                         f"not {model_name!r}")
    for key, xs in (("prefill", "tokens"), ("tpot", "context_tokens")):
        _check_curve(p, doc, key, xs)
    for key, xs, at in (("tpot_batch", "batch", "context_tokens"),
                        ("first_step_extra", "context_tokens", "")):
        if key in doc:
            _check_curve(p, doc, key, xs, at)
    if "verify" in doc:
        _check_verify(p, doc)
    # (key, field, required in key, bound, test): a rate > 0; a ratio to a decode step >= 1
    for key, field, required, bound, ok in (
            ("cache_build", "gb_per_s", True, "> 0", lambda v: v > 0),
            *DRAFT_STEP_FIELDS):
        _check_field(f"hardware profile {p}", doc, key, field, required, bound, ok)
    return doc


# the largest receiver time per later-stream byte a profile or a HELLO may give (s/B)
INGEST_S_PER_BYTE_MAX = 1e-3

# draft_step's fields: (key, field, required in key, bound, test)
DRAFT_STEP_FIELDS = (("draft_step", "ratio", True, ">= 1", lambda v: v >= 1),
                     ("draft_step", "busy_ratio", False, ">= 1", lambda v: v >= 1),
                     ("draft_step", "ingest_s_per_byte", False,
                      f"in [0, {INGEST_S_PER_BYTE_MAX:g}]",
                      lambda v: 0 <= v <= INGEST_S_PER_BYTE_MAX))


def _check_field(where: str, doc: dict, key: str, field: str, required: bool, bound: str,
                 ok: Callable[[float], bool]) -> None:
    """doc[key][field] must be a finite number passing `ok` (where doc has `key`; an
    optional field may be absent); the ValueError names `where`, the field and the bound."""
    entry = doc.get(key)
    if key not in doc or (not required and isinstance(entry, dict) and field not in entry):
        return
    value = (entry or {}).get(field) if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not ok(value):
        raise ValueError(f"{where}: {key}.{field} must be a finite number {bound}, got "
                         f"{value!r}")


def check_draft_step(where: str, doc: dict) -> dict | None:
    """doc's `draft_step` entry, checked (the hardware profile's, or a link profile's: the
    same receiver measured on that link); None without one."""
    for key, field, required, bound, ok in DRAFT_STEP_FIELDS:
        _check_field(where, doc, key, field, required, bound, ok)
    return doc.get("draft_step")
