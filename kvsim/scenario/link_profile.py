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
it describes the run (draft_step_for).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        else 0.0)
    record_loaded(path)
    return profile


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


def draft_step_for(profile: LinkProfile | None, model_name: str, hardware_profile: str
                   ) -> dict | None:
    """The link profile's draft step where it describes this run, for a timing model
    (kvsim.scenario.timing_model.TimingModel's draft_step, which then replaces the hardware
    profile's whole entry): only with a measured hardware profile (`hardware.profile`: the
    draft step is a ratio to that machine's decode step) and for the model it was measured with (its
    `model`, where it names one); else None, and the hardware profile's draft step applies
    (the link's rate, latency and per-message fit apply either way)."""
    draft = profile.draft_step if profile is not None else None
    if not draft or not hardware_profile:
        return None
    if draft.get("model", model_name) != model_name:
        return None
    return draft


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
