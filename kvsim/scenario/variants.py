"""The variants of a scenario: each codec entry with the transfer policy it runs under. Both
engines run the same list (the simulator per variant; the emulator sends each in turn)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvsim.kernels.presets import CodecSpec, resolve_codec
from kvsim.kernels.wire import canonical_json
from kvsim.scenario.config import SimConfig
from kvsim.scenario.policy import POLICIES, natural_policy


@dataclass
class Variant:
    """One codec entry with the transfer policy it runs under."""

    spec: CodecSpec
    policy: str
    acceptance: str | None = None  # per-codec acceptance model (else speculative.acceptance)


def variants(cfg: SimConfig) -> list[Variant]:
    """codecs x transfer: `auto` picks each codec's natural policy; an entry may pin its own
    with a `transfer` key, and its own acceptance model with an `acceptance` key (drafts on
    a 2-bit anchor are accepted less often than on a 4-bit one)."""
    transfers = cfg.transfer if isinstance(cfg.transfer, (list, tuple)) else [cfg.transfer]
    out = []
    for entry in cfg.codecs:
        pinned = acceptance = None
        if isinstance(entry, dict):
            entry = dict(entry)
            pinned = entry.pop("transfer", None)
            acceptance = entry.pop("acceptance", None)
        spec = resolve_codec(entry)
        streams = spec.build().num_streams
        for t in ([pinned] if pinned else transfers):
            policy = natural_policy(streams) if t == "auto" else str(t)
            if policy not in POLICIES:
                raise ValueError(f"unknown transfer {t!r}; choose auto or one of {POLICIES}")
            out.append(Variant(spec, policy, acceptance))
    return _unique_labels(out)


def _unique_labels(out: list[Variant]) -> list[Variant]:
    """Two entries that differ (here: by their acceptance model) never print the same label:
    the label of each such entry names what differs, e.g. `lynx [acceptance=geometric:0.8]`.
    The same setting listed twice keeps its label (repeats: `kvsim validate` runs them)."""
    seen: dict[tuple[str, str], list[Variant]] = {}
    for v in out:
        seen.setdefault((v.spec.label, v.policy), []).append(v)
    for (label, _policy), group in seen.items():
        if len(group) < 2:
            continue
        settings = {(v.spec.name, canonical_json(v.spec.params), v.acceptance)
                    for v in group}
        if len(settings) == 1:  # repeats of one setting
            continue
        for v in group:
            v.spec = replace(v.spec, label=f"{label} [acceptance="
                             f"{v.acceptance or 'speculative.acceptance'}]")
    return out

