"""Measured hardware profiles (`hardware.profile=`: a path or the name of a shipped one,
kvsim.core.profiles; `kvsim calibrate` writes them): loaded and checked here, read by the
timing model (kvsim.scenario.timing_model) in place of the roofline for their model.

The format (JSON):
  {"model": "<model name>", "prefill": {"tokens": [...], "s": [...]},
   "tpot": {"context_tokens": [...], "s": [...]}, "source": "..."}
and optionally (written by `kvsim calibrate`)
  "tpot_batch": {"context_tokens": c, "batch": [...], "s": [...]}    decode step vs batch
      (or at several contexts, as verify below: its ratio to batch 1 interpolated)
  "verify": {"context_tokens": c, "drafted_tokens": [...], "s": [...]}  verification pass
      (or "context_tokens": [c1, ...] and "s": [[...], ...]: measured at several contexts,
      its ratio to the TPOT there interpolated between them)
  "first_step_extra": {"context_tokens": [...], "s": [...]}   first step on a fresh cache
  "tpot_beside_prefill": {"context_tokens": c, "prefill_tokens": p, "batch": [...],
                          "ratio": [...]}   a decode step of each batch size beside a live
                                    p-token prefill in another process of the same host,
                                    over the step alone (>= 1; workload.colocated_prefill);
                                    kvsim.calibrate.beside_prefill also writes each size's
                                    median ("measured", which ratio is fitted to), the
                                    fit and whether it ran on split CPUs
  "tpot_beside_worker": {"context_tokens": c, "codec": name, "batch": [...],
                         "ratio": [...], "extra_s": e}   the same beside a thread running
                                    the receiver's on-arrival worker's layer jobs of
                                    `codec` back to back; what the simulator uses is
                                    extra_s, the s such a worker adds to a step (>= 0;
                                    workload.worker_slows_decode;
                                    kvsim.calibrate.beside_worker)
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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from kvsim.core.data_files import record_loaded

# the curves that are times of a decode-sized forward step: what a step's level moves
STEP_CURVES = ("tpot", "tpot_batch", "verify")


def _scaled_fit(fit: dict | list, factor: float) -> dict | list:
    """A step fit's line(s) x factor (its residuals are relative: unchanged)."""
    if isinstance(fit, list):
        return [_scaled_fit(f, factor) for f in fit]
    return {**fit, **{k: fit[k] * factor for k in ("fixed_s", "s_per_token") if k in fit}}


def scaled_curve(curve: dict, factor: float | Callable[[float], float]) -> dict:
    """A profile curve with its times ("s": a list, or one list per context) x factor: a
    number, or a function of the context (tokens) the times were measured at (the curve's
    "context_tokens": one per point of a context curve, one per row of a verification
    curve measured at several contexts, or the one context of the whole curve)."""
    s = curve["s"]
    if not callable(factor):  # a fitted line (kvsim.calibrate.step_fit) scales with it
        out = {**curve, "s": [[v * factor for v in row] if isinstance(row, list)
                              else row * factor for row in s]}
        if "fit" in curve:
            out["fit"] = _scaled_fit(curve["fit"], factor)
        return out
    curve = {k: v for k, v in curve.items() if k != "fit"}  # no longer that line
    at = curve["context_tokens"]
    if not isinstance(at, list):  # measured at one context: one factor for the curve
        return scaled_curve(curve, factor(float(at)))
    if len(at) != len(s):
        raise ValueError(f"a curve over contexts needs one time (or row) per context, got "
                         f"{len(at)} contexts and {len(s)} rows")
    return {**curve, "s": [[v * factor(float(c)) for v in row] if isinstance(row, list)
                           else row * factor(float(c)) for c, row in zip(at, s, strict=True)]}


def scaled_profile(doc: dict, keys: tuple[str, ...],
                   factor: float | Callable[[float], float]) -> dict:
    """A copy of the hardware profile document `doc` with each of its curves named in `keys`
    scaled by `factor` (scaled_curve); the curves it lacks stay absent, the rest as they are.
    The one way a profile's level is moved: a host's drift (kvsim.model.host), a
    scenario's step probe (kvsim.fidelity.step_probe), the receiver's step ratio
    (kvsim.calibrate.receiver_timing)."""
    return {**doc, **{k: scaled_curve(doc[k], factor) for k in keys if k in doc}}


def _check_at_contexts(path: Path, doc: dict, key: str, xs: str) -> None:
    """doc[key] (verify over drafted_tokens, tpot_batch over batch): measured at one context
    (context_tokens a number, s a list over xs) or at several (context_tokens an increasing
    list, s one such list per context)."""
    curve = doc[key]
    at = curve.get("context_tokens") if isinstance(curve, dict) else None
    if not isinstance(at, list):
        _check_curve(path, doc, key, xs, "context_tokens")
        return
    rows = curve.get("s")
    if not at or not isinstance(rows, list) or len(rows) != len(at):
        raise ValueError(f"hardware profile {path}: {key}.s needs one list per context of "
                         f"{key}.context_tokens")
    # the contexts alone: numbers, increasing (as a curve's x with placeholder times)
    _check_curve(path, {key: {"context_tokens": at, "s": [1.0] * len(at)}}, key,
                 "context_tokens")
    if min(at) <= 0:
        raise ValueError(f"hardware profile {path}: {key}.context_tokens must be > 0")
    for c, row in zip(at, rows, strict=True):
        _check_curve(path, {f"{key} at {c}": {xs: curve.get(xs), "s": row}}, f"{key} at {c}",
                     xs)


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


# entries of a decode step beside other work, over the step alone: key -> (what it is
# beside, its integer fields besides context_tokens, the `kvsim calibrate` setting that
# measures it)
BESIDE_ENTRIES = {
    "tpot_beside_prefill": ("a prefill on the same host", ("prefill_tokens",),
                            "beside_prefill_tokens=<prompt tokens>"),
    "tpot_beside_worker": ("the receiver's on-arrival worker", (),
                           "beside_worker_tokens=<prompt tokens>")}


def _check_beside(path: Path, key: str, entry: object) -> None:
    """tpot_beside_prefill / tpot_beside_worker: `ratio` numbers >= 1 over `batch` sizes >= 1,
    increasing, of one length, measured at context_tokens > 0 (beside a prefill of
    prefill_tokens >= 1; beside the worker's jobs of a named `codec`)."""
    where = f"hardware profile {path}: {key}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping")
    beside, ints, _ = BESIDE_ENTRIES[key]
    batch, ratio = entry.get("batch"), entry.get("ratio")

    def numbers(v: object) -> bool:
        return isinstance(v, list) and bool(v) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in v)
    if not numbers(batch) or not numbers(ratio) or len(batch) != len(ratio):
        raise ValueError(f"{where}: batch and ratio must be lists of finite numbers of one "
                         f"length, got {batch!r} and {ratio!r}")
    if min(batch) < 1 or any(b <= a for a, b in zip(batch, batch[1:], strict=False)):
        raise ValueError(f"{where}: batch must be sizes >= 1 that increase, got {batch}")
    if min(ratio) < 1:
        raise ValueError(f"{where}: ratio must be >= 1 (a step beside {beside} over the step "
                         f"alone), got {ratio}")
    for name in ("context_tokens", *ints):
        v = entry.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {v!r}")
    if key != "tpot_beside_worker":
        return
    if not (isinstance(entry.get("codec"), str) and entry["codec"]):
        raise ValueError(f"{where}: codec must name the codec whose layers the worker "
                         f"dequantized, got {entry.get('codec')!r}")
    extra = entry.get("extra_s")
    if isinstance(extra, bool) or not isinstance(extra, (int, float)) or \
            not math.isfinite(extra) or extra < 0:
        raise ValueError(f"{where}: extra_s must be a number >= 0 (s a busy worker adds to a "
                         f"step), got {extra!r}")


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
    if "first_step_extra" in doc:
        _check_curve(p, doc, "first_step_extra", "context_tokens")
    for key, xs in (("tpot_batch", "batch"), ("verify", "drafted_tokens")):
        if key in doc:
            _check_at_contexts(p, doc, key, xs)
    for key in BESIDE_ENTRIES:
        if key in doc:
            _check_beside(p, key, doc[key])
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
