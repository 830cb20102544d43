"""Decoding on a partial cache: speculative drafting on the anchor, one verification pass.

Timeline (all times in s):
  t_anchor  stream 0 of every layer deserialized: drafting starts, one token per
            draft_tpot_s (TPOT + dequantization overhead), at most `cap` tokens;
  t_full    every stream deserialized. The draft step in progress finishes, then one
            verification pass (a forward over the n drafted tokens, verify_s) on the full
            cache accepts the longest matching prefix (a tokens, drawn from the acceptance
            model) and yields one more token: the correction of the first divergence, or
            the bonus token when all n were accepted;
  then      normal decoding, one token per tpot_s.
Drafted times (`token_t`; the seeds' TTKT counts accepted drafts when they were drafted):
token i <= a at t_anchor + i * draft_tpot_s; token a+1 at the end of verification; token
a+1+j at that time + j * tpot_s. Committed times (`committed_t`; what a user streaming
tokens can show, since a draft is not final until verified): tokens 1..a+1 at the end of
verification, later tokens as drafted. Without drafting (cap 0, or the full cache ready
with the anchor), token j is at t_full + j * tpot_s in both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvsim.scenario.codec_timing import CodecTiming

if TYPE_CHECKING:
    from kvsim.scenario.timing_model import TimingModel

# receiver modes that build the anchor's cache before drafting on it (kvsim's transport:
# transport.dequantize, the simulator's deserializer of the same name): a draft is a plain
# decode step there, slowed only by what runs beside it
ANCHOR_CACHE_MODES = ("on_arrival", "on_demand")


@dataclass(slots=True)  # slots: one per request record
class DecodeTimeline:
    token_t: np.ndarray  # [K] valid time of tokens 1..K (s)
    start_t: float  # decoding (or drafting) began
    full_t: float  # full cache ready
    proposed: int = 0
    accepted: int = 0
    verify_start_t: float = math.nan
    verify_s: float = 0.0
    draft_tpot_s: float = 0.0
    tpot_s: float = 0.0
    segments: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, t0, t1)
    # committed times: tokens 1..commit_count at commit_t (the end of verification, s), the
    # rest as drafted; kept as two numbers, not a second [K] array (a third of a record's
    # memory in a 100,000-request run)
    commit_count: int = 0
    commit_t: float = math.nan
    # the first draft step's end (s; its drafted token's time, accepted or not), nan where
    # nothing was drafted: kvsim.fidelity.first_draft compares it between the engines
    first_draft_t: float = math.nan

    @property
    def committed_t(self) -> np.ndarray:
        """[K] time (s) each token is verified (token_t itself when nothing was drafted)."""
        if self.commit_count == 0:
            return self.token_t
        out = self.token_t.copy()
        out[:self.commit_count] = self.commit_t
        return out

    def committed_at(self, k: int) -> float:
        """committed_t[k - 1] without building the array."""
        return self.commit_t if k <= self.commit_count else float(self.token_t[k - 1])


def commit_head(drafted_t: np.ndarray, committed_t: np.ndarray) -> tuple[int, float]:
    """(commit_count, commit_t) of measured times (the transport's decode loop): committed
    times equal the drafted ones but for a leading run at one time, the end of verification.
    Raises ValueError for times of another shape, which DecodeTimeline cannot hold."""
    if drafted_t.shape != committed_t.shape:
        raise ValueError(f"{len(committed_t)} committed times for {len(drafted_t)} tokens")
    differ = np.flatnonzero(committed_t != drafted_t)
    if len(differ) == 0:
        return 0, math.nan
    count = int(differ[-1]) + 1
    if not (committed_t[:count] == committed_t[0]).all():
        raise ValueError("committed times differ from drafted ones beyond one verification: "
                         f"{committed_t[:count].tolist()}")
    return count, float(committed_t[0])


def draft_overhead_s(configured_s: float | None, timing: CodecTiming, kv_bf16_bytes: float,
                     anchor_bytes: float, total_bytes: float, devices: int,
                     measured_s: float | None = None) -> float:
    """Extra time per drafted token (s): `configured_s` when set (speculative.
    draft_overhead_s); else `measured_s` when given (receiver_draft_s: a receiver that
    builds the anchor's cache before drafting, whose drafts cost only what runs beside
    them); else the dequantization of the anchor from the codec timing: a draft
    step attends over the anchor-only cache, which it dequantizes as it reads it (no bf16
    copy of a partial cache is kept), at the deserializer's cost for the anchor: its byte
    share (anchor_bytes / total_bytes, as kvsim.scenario.policy splits a chunk's decode work
    between streams) of the request's bf16-equivalent cache (`kv_bf16_bytes`) at the
    codec's decode throughput on `devices` devices."""
    if configured_s is not None:
        return float(configured_s)
    if measured_s is not None:
        return float(measured_s)
    share = anchor_bytes / total_bytes if total_bytes > 0 else 0.0
    return share * timing.decode_s(kv_bf16_bytes, devices)


def receiver_draft_s(mode: str, timing: TimingModel, context_tokens: int) -> float | None:
    """`draft_overhead_s`'s measured_s for receiver mode `mode`: in ANCHOR_CACHE_MODES the
    profile's draft step beside the dequantization of the later streams
    (TimingModel.draft_contention_s; 0 where not measured); None for the other
    deserializers (their drafts dequantize the anchor as they read it)."""
    return timing.draft_contention_s(context_tokens) if mode in ANCHOR_CACHE_MODES else None


def receiver_busy_draft_s(mode: str, configured_s: float | None, timing: TimingModel,
                          context_tokens: int) -> float | None:
    """A draft step's extra (s) while the receiver's on-arrival worker dequantizes beside it
    (TimingModel.draft_busy_contention_s), where both engines apply it: dequantization on
    arrival, no configured speculative.draft_overhead_s, a profile that measured
    draft_step.busy_ratio; None otherwise (the constant draft_overhead_s applies)."""
    if mode != "on_arrival" or configured_s is not None:
        return None
    return timing.draft_busy_contention_s(context_tokens)


def busy_share_overhead_s(busy_overhead_s: float, tpot_s: float, busy_share: float) -> float:
    """A draft step's mean extra (s) when the worker is busy `busy_share` of the time:
    drafts advance one step per tpot_s while it is idle and one per r x tpot_s while it
    works (r = 1 + busy_overhead_s / tpot_s, as kvsim.calibrate.receiver_timing measures
    it), so the mean step is tpot_s x r / (r (1 - share) + share), weighting by steps made,
    not by time."""
    if busy_share <= 0.0 or busy_overhead_s <= 0.0:
        return 0.0
    r = 1.0 + busy_overhead_s / tpot_s
    return busy_overhead_s * busy_share / (r * (1.0 - busy_share) + busy_share)


def contention_overhead_s(step_s: float, busy_share: float, contention: float) -> float:
    """A draft step's mean extra (s) while the deserializer dequantizes the later streams on
    the same device `busy_share` of the drafting window and a draft makes no progress for
    `contention` of that time (step_s: the draft step without it, its own overhead
    included): drafts advance at (1 - contention x share) / step_s, so the
    drafting window loses contention x (the later streams' work in it), whatever the
    bandwidth."""
    lost = min(max(contention * busy_share, 0.0), 0.95)  # cap: drafting never stops outright
    return step_s * lost / (1.0 - lost) if lost > 0.0 else 0.0


def plain_decode(t_ready: float, tpot_s: float, tokens: int) -> DecodeTimeline:
    times = t_ready + tpot_s * np.arange(1, tokens + 1)
    return DecodeTimeline(times, t_ready, t_ready, tpot_s=tpot_s,
                          segments=[("decode", t_ready, float(times[-1]))])


def speculative_decode(t_anchor: float, t_full: float, tpot_s: float, draft_tpot_s: float,
                       verify_s: Callable[[int], float], cap: int,
                       sample_accepted: Callable[[int], int], tokens: int) -> DecodeTimeline:
    if t_full < t_anchor:
        raise ValueError(f"full cache ready ({t_full}) before the anchor ({t_anchor})")
    gap = t_full - t_anchor
    proposed = 0 if cap <= 0 or gap <= 0 else min(cap, math.ceil(gap / draft_tpot_s - 1e-12))
    if proposed == 0:
        tl = plain_decode(t_full, tpot_s, tokens)
        if t_full > t_anchor:
            tl.segments.insert(0, ("wait", t_anchor, t_full))
        tl.start_t = t_anchor
        return tl
    accepted = int(sample_accepted(proposed))
    if not 0 <= accepted <= proposed:
        raise ValueError(f"acceptance model returned {accepted} of {proposed} drafted tokens")
    draft_end = t_anchor + proposed * draft_tpot_s
    v_start = max(t_full, draft_end)
    v_s = verify_s(proposed)
    v_end = v_start + v_s
    times = np.empty(tokens)
    i = np.arange(1, tokens + 1)
    times[:] = v_end + (i - accepted - 1) * tpot_s
    head = min(accepted, tokens)
    times[:head] = t_anchor + i[:head] * draft_tpot_s
    seg = [("draft_accepted", t_anchor, t_anchor + accepted * draft_tpot_s),
           ("draft_rejected", t_anchor + accepted * draft_tpot_s, draft_end)]
    if v_start > draft_end:
        seg.append(("wait", draft_end, v_start))
    seg.append(("verify", v_start, v_end))
    if tokens > accepted + 1:
        seg.append(("decode", v_end, float(times[-1])))
    # committed: drafts count once verification accepts them
    return DecodeTimeline(times, t_anchor, t_full, proposed, accepted, v_start, v_s,
                          draft_tpot_s, tpot_s, seg, min(accepted + 1, tokens), v_end,
                          t_anchor + draft_tpot_s)
