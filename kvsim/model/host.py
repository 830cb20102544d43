"""The host a measured profile describes, and what to do when the host running kvsim now is
not that host (or is, on a slower day).

A hardware profile written by `kvsim calibrate` times the real model on one machine at one
time. Read elsewhere, or on a day the machine is busier, its times are off by however much
the decode step moved, and nothing else in the simulator can tell (issue 44 found a day with
the step ~2x the calibrated one and every error inheriting it). The calibration therefore
records its host (`host`: CPU model, CPUs, a memory-copy bandwidth and a decode-step probe at
its contexts); `kvsim sim` and `kvsim validate` probe this host the same way and either
rescale the profile's times by the step's factor at each context (and the codec timing and
links calibrated with it by the shortest context's) or refuse, by `drift.action`
(kvsim.calibrate.host_probe runs the probe).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.core.checks import check_choice

DRIFT_ACTIONS = ("rescale", "refuse", "off")
DRIFT_WHEN = ("other_host", "always")

# the profile curves that are times of the real model's work on this host (scaled together:
# a slower day slows the prefill as it slows a step; the in-process curves the receiver's
# ratio was taken against too, so a rescaled profile checked again finds its own level)
TIME_CURVES = ("prefill", "tpot", "tpot_batch", "verify", "first_step_extra",
               "tpot_inprocess", "first_step_extra_inprocess")


@dataclass
class DriftConfig:
    """What a run with a measured hardware profile does about the host it runs on."""

    # beyond the tolerance: rescale (the profile's model times x the probe's factor, stated
    # in the rows) | refuse (exit with the figures) | off (no probe, the profile as it is)
    action: str = "rescale"
    # when `kvsim sim` probes: other_host (the profile names another CPU model or CPU
    # count; a profile naming none is not probed) | always (~12 s: the model loads)
    when: str = "other_host"
    tolerance_pct: float = 10.0  # |step now / step in the profile - 1| within: as it is

    def __post_init__(self) -> None:
        check_choice("drift.action", self.action, DRIFT_ACTIONS)
        check_choice("drift.when", self.when, DRIFT_WHEN)
        if not 0 <= self.tolerance_pct < 1000:
            raise ValueError(f"drift.tolerance_pct must be in [0, 1000), got "
                             f"{self.tolerance_pct}")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fingerprint() -> dict:
    """What names this host's kind: CPU model, logical CPUs, CPUs usable by this process."""
    return {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count() or 1,
            "usable_cpus": usable_cpus()}


def memory_copy_gb_per_s(size_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """This host's memory bandwidth as one thread copies `size_bytes` (GB/s of bytes copied,
    read + write counted once; the best of `repeats`: ~0.2 s)."""
    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return size_bytes / best / 1e9


def other_host(recorded: dict | None, now: dict) -> bool | None:
    """Whether `now` (fingerprint()) is another kind of host than `recorded` (a profile's
    `host`): CPU model or logical CPU count differ; None when the profile records neither."""
    if not recorded or "cpu_model" not in recorded:
        return None
    return (recorded.get("cpu_model"), recorded.get("logical_cpus")) != \
        (now["cpu_model"], now["logical_cpus"])


def factor_at(contexts: list[int], factors: list[float]) -> Callable[[float], float]:
    """A rescale's factor as a function of context (tokens): the probed factors, linear in
    context between the probed contexts and flat beyond them."""
    xs, ys = [float(c) for c in contexts], [float(f) for f in factors]
    return lambda c: float(np.interp(c, xs, ys))


def rescaled_profile(doc: dict, factor: float | list[float], drift: dict,
                     contexts: list[int] | None = None) -> dict:
    """A hardware profile document with every model time (TIME_CURVES) rescaled and the
    drift that led to it recorded under `drift`. factor: one number for every time, or one
    per probed context (`contexts`, increasing): the step curves (decode, batch,
    verification, first-step extra) then by factor_at over their contexts, the prefill by
    the shortest context's factor (a prefill is neither probe's kind of work; its level
    follows the fixed part of a step, as one factor did)."""
    from kvsim.model.hardware_profile import scaled_curve

    factors = [float(factor)] if not isinstance(factor, list) else [float(f) for f in factor]
    at = [0] if contexts is None else [int(c) for c in contexts]
    if len(at) != len(factors) or not factors:
        raise ValueError(f"a rescale needs one factor per probed context, got {factors} at "
                         f"{at}")
    if not all(f > 0 for f in factors):
        raise ValueError(f"a rescale factor must be > 0, got {factors}")
    if any(b <= a for a, b in zip(at, at[1:], strict=False)):
        raise ValueError(f"a rescale's contexts must increase, got {at}")
    by_context = factor_at(at, factors)
    out = dict(doc)
    for key in TIME_CURVES:
        if key in doc:
            out[key] = scaled_curve(doc[key], factors[0] if key == "prefill" or
                                    len(factors) == 1 else by_context)
    out.update(receiver_work_scaled(doc, factors[0]))
    host = out.get("host")
    probe = host.get("decode_step_probe") if isinstance(host, dict) else None
    if isinstance(probe, dict):  # the profile now describes this host's level: its probe
        step, where = probe.get("s"), probe.get("context_tokens")  # is the one taken here
        if isinstance(step, list) and isinstance(where, list) and len(step) == len(where):
            out["host"] = {**host, "decode_step_probe": {
                **probe, "s": [v * by_context(c) for c, v in zip(where, step, strict=True)]}}
        elif isinstance(step, (int, float)) and isinstance(where, (int, float)):
            out["host"] = {**host, "decode_step_probe": {**probe,
                                                         "s": step * by_context(where)}}
    what = f"x {factors[0]:.4g}" if len(factors) == 1 else \
        (f"x {' / '.join(f'{f:.4g}' for f in factors)} at {' / '.join(map(str, at))} tokens "
         f"(linear in context between; the prefill x {factors[0]:.4g})")
    what += f"; cache build GB/s and receiver s per byte taken in by x {factors[0]:.4g}"
    out["drift"] = {**drift, "factor": factors[0] if len(factors) == 1 else factors,
                    **({} if contexts is None else {"contexts": at}),
                    "what": f"{', '.join(k for k in TIME_CURVES if k in doc)} {what}: "
                            "this host's decode step over the profile's"}
    return out


def write_rescaled_profile(doc: dict, out_path: Path, factor: float | list[float],
                           drift: dict, contexts: list[int] | None = None) -> Path:
    """Write rescaled_profile(doc, factor, drift, contexts) to out_path (its folder made);
    returns out_path. drift names where doc came from (from_profile) and why it moves."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(rescaled_profile(doc, factor, drift, contexts), indent=1)
                        + "\n")
    return out_path


def rescaled_codec_timing(doc: dict, factor: float, drift: dict, key: str = "drift") -> dict:
    """A measured codec timing document (kvsim.scenario.codec_timing) of a host `factor` x
    as slow: every rate (`*gb_per_s`) / factor and every fixed time (`*fixed_s`) x factor,
    for each codec; the record `drift` (why it moved) kept under `key` (a drift rescale's
    `drift`; a scenario's step level's `step_level`, kvsim.fidelity.step_probe). The codecs'
    kernels are the host's memory-bound work outside the model's step, the kind of work a
    short-context step's fixed part is (its weights read once): on 2026-11-29 a full grid
    against a profile calibrated that morning (factor 0.62) gave mean 5.19% / worst 31.75%
    with the codec timings as measured and 4.00% / 14.54% with them rescaled too."""
    if not factor > 0:
        raise ValueError(f"a rescale factor must be > 0, got {factor}")

    def one(entry: dict) -> dict:
        out = dict(entry)
        for key, value in entry.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key.endswith("gb_per_s"):
                out[key] = value / factor
            elif key.endswith("fixed_s"):
                out[key] = value * factor
        return out

    codecs = doc.get("codecs")
    if not isinstance(codecs, dict):
        raise ValueError("a codec timing document needs `codecs` (one entry per codec)")
    default = doc.get("default")
    return {**doc, "codecs": {name: one(e) if isinstance(e, dict) else e
                              for name, e in codecs.items()},
            **({"default": one(default)} if isinstance(default, dict) else {}),
            key: {**drift, "factor": factor,
                  "what": f"rates / {factor:.4g}, fixed times x {factor:.4g}: the host's "
                          "decode step over the hardware profile's"}}


def rescaled_link_profile(doc: dict, factor: float, drift: dict, key: str = "drift") -> dict:
    """A measured link profile with the transport's CPU times x factor: the receiver's time
    per byte taken in (`draft_step.ingest_s_per_byte`) and a transfer's handshake
    (`handshake_s`: both ends' processes at work); the link's own terms (rate, goodput,
    latency, per-message bytes), the draft step's ratios to a step and the worker's pace
    (`worker_pace`: ratios to the codec timing's jobs, which are rescaled with it) stay; the
    record `drift` kept under `key`, as rescaled_codec_timing."""
    if not factor > 0:
        raise ValueError(f"a rescale factor must be > 0, got {factor}")
    scaled = _ingest_scaled(doc, factor)
    what = ["draft_step.ingest_s_per_byte"] if scaled else []
    if isinstance(doc.get("handshake_s"), (int, float)):
        scaled["handshake_s"] = doc["handshake_s"] * factor
        what.append("handshake_s")
    return {**doc, **scaled, key: {**drift, "factor": factor, "what": (
        f"{' and '.join(what)} x {factor:.4g}" if what else "nothing to rescale")}}


def receiver_work_scaled(doc: dict, factor: float) -> dict:
    """The hardware profile's keys for the receiver's CPU work outside the model's step, on a
    host `factor` x as slow, as the codecs' (rescaled_codec_timing): its cache build
    (`cache_build.gb_per_s` / factor) and, where measured there, its time per later-stream
    byte taken in (x factor); {} where doc has neither."""
    out = _ingest_scaled(doc, factor)
    build = doc.get("cache_build")
    if isinstance(build, dict) and isinstance(build.get("gb_per_s"), (int, float)):
        out["cache_build"] = {**build, "gb_per_s": build["gb_per_s"] / factor}
    return out


def _ingest_scaled(doc: dict, factor: float) -> dict:
    """{"draft_step": ...} with the receiver's time per later-stream byte taken in x factor,
    where doc (a hardware or link profile) measured it; else {}."""
    step = doc.get("draft_step")
    if not isinstance(step, dict) or not isinstance(step.get("ingest_s_per_byte"),
                                                    (int, float)):
        return {}
    return {"draft_step": {**step, "ingest_s_per_byte": step["ingest_s_per_byte"] * factor}}
