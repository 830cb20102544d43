"""A measured link profile (`link.profile`): what `kvsim calibrate` (kvsim.calibrate.link_profile)
fitted to real transfers over an emulated link, applied to the simulator's egress links so
their transfer times match the real transport's:

    bandwidth_gbps         x efficiency              (payload goodput / configured rate)
    latency_s              + profile latency_s       (fixed start cost of a transfer)
    message_overhead_bytes + profile overhead bytes  (per-message cost beyond the payload)
    handshake_s            + profile handshake_s     (a transfer's set-up before its
                                                      encoder starts; absent: 0)

A bandwidth trace's rates are scaled by the efficiency too: the profile describes the
emulation, whatever rate it is set to. The file format is kvsim.calibrate.link_profile's
(version 1, kind "link").

A profile written by `kvsim calibrate` with its receiver timing also carries the receiver's
draft step measured on that link (`draft_step`: ratio, busy_ratio, ingest_s_per_byte, as in
the hardware profile): a draft step beside the receiver's work on the later streams is slower
on a `tc`-shaped veth than on the token bucket: taking the bytes in costs the host more
there (measured: kvsim.calibrate.draft_ingest). The run's timing model takes it in
place of the hardware profile's (kvsim.scenario.timing_model.TimingModel's draft_step) where
it describes the run (draft_step_for). Such a profile also carries how fast the receiver's
on-arrival worker dequantizes on that link (`worker_pace`: alone, encoder, ingest;
kvsim.calibrate.worker_pace): on one host, its jobs take longer while the sender's encoder
shares the cores and while the request's bytes are taken in (worker_pace_for), and how much
longer a pipelined request's encoder takes beside its own transfer at the link's rate
(`encoder_pace`: ratios at two rates; kvsim.calibrate.encoder_pace, encoder_ratio).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.core.data_files import record_loaded
from kvsim.core.profiles import profile_path
from kvsim.model.hardware_profile import check_draft_step

VERSION = 1
EFFICIENCY_MAX = 1.2  # = kvsim.calibrate.link_profile.EFFICIENCY_MAX
EMULATIONS = ("token_bucket", "tc", "none")


@dataclass(frozen=True)
class LinkProfile:
    efficiency: float  # payload goodput / configured rate, in (0, 1.2]
    latency_s: float  # added to every message's delivery (s), >= 0
    message_overhead_bytes: float  # bytes per message beyond its payload, >= 0
    name: str
    path: str  # the JSON file it came from
    # the receiver's draft step measured on this link ({"ratio", "busy_ratio"?, "model"?,
    # ...}: kvsim.model.hardware's draft_step), None where the profile has none
    draft_step: dict | None = None
    emulation: str = "none"  # the link emulation it was measured on (EMULATIONS)
    # a transfer's set-up on this link, measured by the transport (s; kvsim.transport.record
    # handshake_s): 0 where the profile has none (fitted on plain messages only)
    handshake_s: float = 0.0
    # the on-arrival worker's pace on this link ({"alone", "encoder", "ingest",
    # "model", ...}: kvsim.calibrate.worker_pace), None where the profile has none
    worker_pace: dict | None = None
    # a pipelined request's encoder work over the codec timing's at the link's rate
    # ({"rates_gbps", "ratio", "model", ...}: kvsim.calibrate.encoder_pace), None without
    encoder_pace: dict | None = None


def _number(path: Path, doc: dict, key: str, minimum: float, maximum: float = math.inf,
            strict: bool = False) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"link profile {path}: {key} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"link profile {path}: {key} must be finite, got {value!r}")
    if x < minimum or (strict and x == minimum) or x > maximum:
        low = "(" if strict else "["
        raise ValueError(f"link profile {path}: {key} must be in {low}{minimum:g}, "
                         f"{maximum:g}], got {value!r}")
    return x


def load_link_profile(name_or_path: str) -> LinkProfile:
    """The profile named `name_or_path` (data/profiles/link/<name>.json, or a path), every
    field checked; a ValueError names the file and the field."""
    path = profile_path("link", name_or_path)
    try:
        doc: Any = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"link profile {path}: not readable JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"link profile {path}: must be a JSON object")
    if doc.get("version") != VERSION:
        raise ValueError(f"link profile {path}: version must be {VERSION}, got "
                         f"{doc.get('version')!r}")
    if doc.get("kind") != "link":
        raise ValueError(f"link profile {path}: kind must be 'link', got {doc.get('kind')!r}")
    if doc.get("emulation", "none") not in EMULATIONS:
        raise ValueError(f"link profile {path}: emulation must be one of {EMULATIONS}, got "
                         f"{doc.get('emulation')!r}")
    name = doc.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ValueError(f"link profile {path}: name must be a non-empty string")
    profile = LinkProfile(
        efficiency=_number(path, doc, "efficiency", 0.0, EFFICIENCY_MAX, strict=True),
        latency_s=_number(path, doc, "latency_s", 0.0),
        message_overhead_bytes=_number(path, doc, "message_overhead_bytes", 0.0),
        name=name, path=str(path),
        draft_step=check_draft_step(f"link profile {path}", doc),
        emulation=doc.get("emulation", "none"),
        handshake_s=_number(path, doc, "handshake_s", 0.0, 1.0) if "handshake_s" in doc
        else 0.0,
        worker_pace=_worker_pace(path, doc), encoder_pace=_encoder_pace(path, doc))
    record_loaded(path)
    return profile


# worker_pace's fields: (name, lowest, highest), which kvsim.calibrate.worker_pace's fit
# keeps to; `alone` > its lowest
WORKER_PACE_FIELDS = (("alone", 0.0, 10.0), ("encoder", 0.0, 10.0), ("ingest", 0.0, 10.0))


def _worker_pace(path: Path, doc: dict) -> dict | None:
    """doc's `worker_pace` entry, checked (None without one)."""
    pace = doc.get("worker_pace")
    if pace is None:
        return None
    if not isinstance(pace, dict):
        raise ValueError(f"link profile {path}: worker_pace must be an object")
    for key, low, high in WORKER_PACE_FIELDS:
        _number(path, {f"worker_pace.{key}": pace.get(key)}, f"worker_pace.{key}", low, high,
                strict=key == "alone")
    return pace


ENCODER_RATIO_MAX = 10.0  # encoder_pace's largest ratio (kvsim.calibrate.encoder_pace too)


def _encoder_pace(path: Path, doc: dict) -> dict | None:
    """doc's `encoder_pace` entry, checked: two or more increasing rates (Gbps, > 0) and as
    many ratios in (0, ENCODER_RATIO_MAX] (None without one)."""
    pace = doc.get("encoder_pace")
    if pace is None:
        return None
    rates = pace.get("rates_gbps") if isinstance(pace, dict) else None
    ratios = pace.get("ratio") if isinstance(pace, dict) else None
    numbers = isinstance(rates, list) and isinstance(ratios, list) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for v in [*rates, *ratios])
    if not (numbers and len(rates) >= 2 and len(ratios) == len(rates)
            and all(0 < a < b for a, b in zip(rates[:-1], rates[1:], strict=True))
            and all(0 < x <= ENCODER_RATIO_MAX for x in ratios)):
        raise ValueError(f"link profile {path}: encoder_pace needs rates_gbps (two or more, "
                         f"increasing, > 0) and as many ratios in (0, {ENCODER_RATIO_MAX:g}], "
                         f"got {pace!r}")
    return pace


def encoder_ratio(pace: dict, bandwidth_gbps: float) -> float:
    """A pipelined request's encode time over the codec timing's at `bandwidth_gbps`: the
    profile's ratios interpolated linearly in the rate, held beyond its rates."""
    return float(np.interp(bandwidth_gbps, pace["rates_gbps"], pace["ratio"]))


def profiled_link_settings(bandwidth_gbps: float, latency_s: float,
                           message_overhead_bytes: float, trace: list[list[float]],
                           profile: LinkProfile | None) -> dict:
    """The egress Link's keyword settings with `profile` applied (unchanged without one)."""
    if profile is None:
        return {"bandwidth_gbps": bandwidth_gbps, "latency_s": latency_s,
                "message_overhead_bytes": message_overhead_bytes, "trace": trace}
    eff = profile.efficiency
    return {"bandwidth_gbps": bandwidth_gbps * eff,
            "latency_s": latency_s + profile.latency_s,
            "message_overhead_bytes": message_overhead_bytes + profile.message_overhead_bytes,
            "trace": [[float(t), float(gbps) * eff] for t, gbps in trace]}


def _for_run(entry: dict | None, model_name: str, hardware_profile: str) -> dict | None:
    """A link profile's receiver entry (measured against a calibration's hardware profile)
    where it describes this run: with a measured hardware profile, for the model it was
    measured with (its `model`, where it names one); else None."""
    if not entry or not hardware_profile or entry.get("model", model_name) != model_name:
        return None
    return entry


def draft_step_for(profile: LinkProfile | None, model_name: str, hardware_profile: str
                   ) -> dict | None:
    """The link profile's draft step where it describes this run, for a timing model
    (kvsim.scenario.timing_model.TimingModel's draft_step, which then replaces the hardware
    profile's whole entry): only with a measured hardware profile (`hardware.profile`: the
    draft step is a ratio to that machine's decode step) and for the model it was measured
    with; else None, and the hardware profile's draft step applies (the link's rate,
    latency and per-message fit apply either way)."""
    return _for_run(profile.draft_step if profile is not None else None, model_name,
                    hardware_profile)


def worker_pace_for(profile: LinkProfile | None, model_name: str, hardware_profile: str
                    ) -> dict | None:
    """The link profile's worker pace where it describes this run, as draft_step_for; else
    None (the worker's jobs take the codec timing's time). Its `alone` is a ratio to the
    codec timing of the calibration that wrote it, which a run names separately
    (`codec_timing=`): with another one, the ratio is applied to that one's jobs."""
    return _for_run(profile.worker_pace if profile is not None else None, model_name,
                    hardware_profile)


def encoder_pace_for(profile: LinkProfile | None, model_name: str, hardware_profile: str
                     ) -> dict | None:
    """The link profile's encoder pace where it describes this run, as draft_step_for (its
    ratios are to the codec timing of the calibration that wrote it); else None."""
    return _for_run(profile.encoder_pace if profile is not None else None, model_name,
                    hardware_profile)


def link_draft_step(name_or_path: str, model_name: str, hardware_profile: str,
                    emulation: str) -> dict | None:
    """`kvsim emulate`'s timing-model decode: the draft step of link.profile `name_or_path`
    ("": none) as draft_step_for gives it, so that it drafts as `kvsim sim` does on that
    link. A profile measured on another emulation than `emulation` (transport.emulation)
    is refused: its draft step describes a link this run does not have."""
    if not name_or_path:
        return None
    profile = load_link_profile(name_or_path)
    if profile.emulation != emulation:
        raise ValueError(f"link.profile {profile.path} was measured on emulation "
                         f"{profile.emulation!r}, but transport.emulation={emulation}: give "
                         f"the profile of {emulation!r} (or none)")
    return draft_step_for(profile, model_name, hardware_profile)
