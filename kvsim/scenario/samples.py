"""How many runs a row averages: where its times are random draws (drafts accepted by chance,
random arrivals), one run is one draw, and a comparison between codecs would be decided by
it; such a run averages at least `min_samples` runs. `kvsim sim`, `sweep` and `advise` all
apply this, so the same setting gives the same times by every command."""

from __future__ import annotations

from collections.abc import Iterable

from kvsim.scenario.config import SimConfig

DRAWN_WORKLOADS = ("poisson", "azure")  # workload kinds whose arrivals or contexts are drawn


def drawn_because(cfg: SimConfig, policies: Iterable[str]) -> str:
    """What makes the times of rows under these policies random ("" if nothing does): drafts
    accepted by chance (a split-stream row that drafts) or random arrivals. A split-stream
    policy only runs for a codec of several streams (kvsim.scenario.policy.applicable)."""
    why = []
    if cfg.speculative.cap_tokens > 0 and any(p.startswith("split_stream") for p in policies):
        why.append("speculative acceptance")
    if cfg.workload.kind in DRAWN_WORKLOADS:
        why.append(f"{cfg.workload.kind} arrivals")
    return " and ".join(why)


def enough_samples(cfg: SimConfig, policies: Iterable[str]) -> str:
    """Raise cfg.samples to cfg.min_samples where the times are drawn; returns the note that
    says so ("" when nothing changed)."""
    why = drawn_because(cfg, policies)
    if not why or cfg.samples >= cfg.min_samples:
        return ""
    note = (f"samples={cfg.samples} raised to {cfg.min_samples} (min_samples): the times "
            f"depend on {why}, and one draw would decide between codecs")
    cfg.samples = cfg.min_samples
    return note
