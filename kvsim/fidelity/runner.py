"""Run one validation scenario twice: emulated (the real transport, `kvsim emulate`) and
simulated (`kvsim sim` with the calibrated profiles), from the same scenario keys.

The simulator gets what calibration measured and nothing from the emulated run it is
compared with: the hardware profile (prefill, decode step, verification), the codec timing
of the transport's two ends, the link profile of the emulation, the receiver's mode of
dequantization that the codec timing was measured in (`receiver_dequantize`: the transport
runs `transport.dequantize=` and the simulator `deserializer=` of that name; profiles
without it were measured on demand), the draft step (below) and the acceptance curve
measured by `kvsim quality` on the same model. Both engines run the transport's receiver
mode, where a draft is a plain decode step on the anchor's cache plus what calibration
measured of one beside the receiver's dequantization (the link profile's `draft_step`,
measured on that link, else the hardware profile's; 0 where not measured:
kvsim.scenario.speculative.receiver_draft_s).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Profiles:
    """The calibrated profile files one validation uses."""

    hardware: Path
    codec_timing: Path
    links: dict[str, Path]  # emulation -> link profile
    dequantize: str = "on_demand"  # the receiver mode the codec timing was measured in


def find_profiles(root: Path, name: str, emulations: list[str]) -> Profiles:
    """The files `kvsim calibrate out_dir=ROOT name=NAME` wrote (ROOT/hardware/NAME.json,
    ROOT/codec_timing/NAME.json, ROOT/link/NAME-<emulation>.json)."""
    hw, ct = root / "hardware" / f"{name}.json", root / "codec_timing" / f"{name}.json"
    links = {e: root / "link" / f"{name}-{e.replace('_', '-')}.json" for e in emulations}
    missing = [p for p in (hw, ct, *links.values()) if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"calibrated profile {name!r} is incomplete under {root}: missing "
            f"{', '.join(str(p) for p in missing)}; run `kvsim calibrate out_dir={root} "
            f"name={name}` (with links=[{','.join(emulations)}]) or validate calibrate=true")
    mode = json.loads(ct.read_text()).get("receiver_dequantize", "on_demand")
    return Profiles(hw, ct, links, mode)


def override_list(items: list[Any]) -> str:
    """A Hydra override's list value: [a,b,...] (nested lists as they print)."""
    return "[" + ",".join(str(x) for x in items) + "]"


def scenario_overrides(model: str, emulation: str, bandwidth_gbps: float, codecs: list[Any],
                       workload: list[str], ks: list[int], profiles: Profiles,
                       split_cpus: bool = False) -> list[str]:
    """The keys both engines read (`kvsim emulate` / `kvsim sim` overrides). The hardware
    profile is the emulator's timing model too (a modelled prefill, timing-model decode),
    and so is the link profile's draft step (the simulator's link is the profile's).
    Transfer is the seeds' pairing (monolithic / split_stream): the policies the shipped
    validations measured."""
    return [f"model={model}", "hardware=local-cpu", f"hardware.profile={profiles.hardware}",
            "transfer=seeds",
            f"codec_timing={profiles.codec_timing}", "link=emulated",
            f"link.bandwidth_gbps={bandwidth_gbps}", f"link.profile={profiles.links[emulation]}",
            f"codecs={override_list(codecs)}",
            f"metrics.ks={override_list(sorted({1, *ks}))}",
            f"transport.emulation={emulation}", f"transport.dequantize={profiles.dequantize}",
            f"transport.split_cpus={split_cpus}", *workload]


def sim_overrides(common: list[str], profiles: Profiles, acceptance: str, samples: int
                  ) -> list[str]:
    out = [o for o in common if not o.startswith("transport.")]
    return ["scenario=none", *out, f"deserializer={profiles.dequantize}",
            f"speculative.acceptance={acceptance}", f"samples={samples}"]


def run_pair(common: list[str], sim: list[str], host: Any = None
             ) -> tuple[list[dict], list[dict]]:
    """(emulated rows, simulated rows) of one scenario, one row per codec each; `host`: a
    decode host kept over scenarios (kept_decode_host)."""
    return emulate_rows(common, host), simulate(sim)


def emulate_rows(common: list[str], host: Any = None) -> list[dict]:
    """The emulated rows of one scenario (`kvsim emulate` with these overrides), one per
    codec (repeats aggregated); raises if a request did not finish. `host`: the
    kept_decode_host to send to (None: one started for this scenario alone)."""
    from kvsim.core.compose import compose
    from kvsim.transport.config import EmulateConfig
    from kvsim.transport.emulate import emulate
    from kvsim.transport.record import aggregate_rows

    ecfg, _ = compose("transport", common, EmulateConfig)
    measured = aggregate_rows(emulate(ecfg, host))
    failed = [r for r in measured if r.get("status") not in ("done", None)]
    if failed:
        raise RuntimeError(f"emulated run failed ({' '.join(common)}): "
                           f"{failed[0].get('status')}: {failed[0].get('error')}")
    return measured


@contextlib.contextmanager
def kept_decode_host(common: list[str], warm_context_tokens: int = 0) -> Iterator[Any]:
    """One decode host (`kvsim serve`) for every scenario of these overrides' emulation
    that follows, started once instead of once per scenario
    (kvsim.transport.emulate.DecodeHost; with tc, one shaped link too, reshaped to each
    scenario's rate), warmed up for prompts up to warm_context_tokens."""
    from kvsim.core.compose import compose
    from kvsim.transport.config import EmulateConfig
    from kvsim.transport.emulate import DecodeHost

    ecfg, _ = compose("transport", common, EmulateConfig)
    ecfg.validate()
    with DecodeHost(ecfg, warm_context_tokens=warm_context_tokens) as host:
        yield host


def simulate(sim: list[str]) -> list[dict]:
    """The simulated rows of one scenario (`kvsim sim` with these overrides), one per codec."""
    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig
    from kvsim.sim.run import run_all

    scfg, _ = compose("sim", sim, SimConfig)
    simulated, _trace = run_all(scfg)
    return simulated


def by_codec(rows: list[dict]) -> dict[str, dict]:
    return {str(r["codec"]): r for r in rows}
