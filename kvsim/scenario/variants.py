"""The variants of a scenario: each codec entry with the transfer policy it runs under. Both
engines run the same list (the simulator per variant; the emulator sends each in turn)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvsim.kernels.presets import CodecSpec, resolve_codec
from kvsim.kernels.wire import canonical_json
from kvsim.scenario.policy import TRANSFER_CHOICES, applicable, chosen_policy


class CodecsAndTransfer(Protocol):
    """What variants() reads of a SimConfig (named so: SimConfig.validate calls
    plan_variants, and this module does not import the config)."""

    codecs: list[Any]
    transfer: Any


@dataclass
class Variant:
    """One codec entry with the transfer policy it runs under."""

    spec: CodecSpec
    policy: str
    acceptance: str | None = None  # per-codec acceptance model (else speculative.acceptance)


def variants(cfg: CodecsAndTransfer) -> list[Variant]:
    """codecs x transfer (`auto` is the best policy each codec supports:
    kvsim.scenario.policy.chosen_policy); an entry may pin its own policy with a `transfer`
    key, and its own acceptance model with an `acceptance` key (drafts on a 2-bit anchor are
    accepted less often than on a 4-bit one)."""
    return plan_variants(cfg.codecs, cfg.transfer)[0]


def plan_variants(codecs: list[Any], transfer: Any) -> tuple[list[Variant], list[str]]:
    """(variants, skipped): a split-stream policy a one-stream codec cannot use gives no
    variant and is named in `skipped` ('codec/policy'); pinned on the entry, or with no
    variant left, it is a ValueError."""
    transfers = transfer if isinstance(transfer, (list, tuple)) else [transfer]
    out: list[Variant] = []
    skipped: list[str] = []
    for entry in codecs:
        pinned = acceptance = None
        if isinstance(entry, dict):
            entry = dict(entry)
            pinned = entry.pop("transfer", None)
            acceptance = entry.pop("acceptance", None)
        spec = resolve_codec(entry)
        codec = spec.build()
        for t in ([pinned] if pinned else transfers):
            if t not in TRANSFER_CHOICES:
                raise ValueError(f"transfer: unknown policy {t!r}; choose one of "
                                 f"{', '.join(TRANSFER_CHOICES)}")
            policy = chosen_policy(str(t), codec.num_streams, codec.layer_independent)
            if not applicable(policy, codec.num_streams):
                if pinned:
                    raise ValueError(f"codec {spec.label}: transfer {policy} needs several "
                                     f"streams and {spec.label} has one; pin layerwise or "
                                     "monolithic")
                skipped.append(f"{spec.label}/{policy}")
                continue
            out.append(Variant(spec, policy, acceptance))
    if not out:
        raise ValueError(f"transfer={transfer}: no listed codec can use it (split-stream "
                         f"policies need a codec of several streams; skipped "
                         f"{', '.join(skipped)}); add layerwise or transfer=auto")
    return _unique_labels(out), skipped


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

