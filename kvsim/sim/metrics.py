"""Per-request outcomes, the Figure-2 breakdown, and multi-request aggregates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from kvsim.sim.speculative import DecodeTimeline

BREAKDOWN_KEYS = ("serialize", "exposed_communication", "deserialize", "queueing", "decode",
                  "rejected_speculative", "verification")
# the breakdown part a decode timeline segment counts towards ("wait": see breakdown)
_SEGMENT_PART: dict[str, str] = {
    "draft_accepted": "decode", "draft_rejected": "rejected_speculative",
    "verify": "verification", "decode": "decode"}


@dataclass
class RequestRecord:
    seq: int
    context_tokens: int
    arrival_t: float
    prefill_start_t: float
    prefill_end_t: float
    encode_end_t: float  # last chunk encoded
    needed_arrival_t: float  # last byte of the flows decoding waits for arrived
    needed_backlog_t: float  # ... whose final backlog on the link began then (see below)
    needed_ready_t: float  # ... and was deserialized (decode may start)
    all_arrival_t: float  # last byte of every flow arrived
    full_ready_t: float  # every stream deserialized
    decode_start_t: float  # decode slot obtained and cache usable
    timeline: DecodeTimeline
    stream_bytes: list[int]
    received_bytes: float
    monolithic: bool
    extra: dict = field(default_factory=dict)

    def ttkt(self, k: int) -> float:
        return float(self.timeline.token_t[k - 1])

    def ttkt_committed(self, k: int) -> float:
        return float(self.timeline.committed_t[k - 1])

    def breakdown(self, k: int) -> dict[str, float]:
        """Split [prefill end, TTKT(k)] along the critical path; the parts sum to it.

        Transfer: the needed flow's last byte arrived at needed_arrival_t; walking back, its
        flow had bytes queued on the link without a break since needed_backlog_t (the
        release of the message that found the flow empty). Before that instant the flow
        waited for the encoder (serialize), after it for the link (exposed communication:
        its own bytes, others' ahead of it, latency). Monolithic: everything is released
        at the end of encoding, so serialize is the whole encode after prefill; pipelined
        with an encoder slower than the link: the last chunk found the flow empty, so
        serialize is the encoding up to it and communication only its transfer."""
        out = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
        t_pe, end = self.prefill_end_t, self.ttkt(k)
        exposed = max(0.0, self.needed_arrival_t - t_pe)
        out["serialize"] = min(exposed, max(0.0, self.needed_backlog_t - t_pe))
        out["exposed_communication"] = exposed - out["serialize"]
        out["deserialize"] = self.needed_ready_t - max(self.needed_arrival_t, t_pe)
        out["queueing"] = self.decode_start_t - self.needed_ready_t
        for kind, t0, t1 in self.timeline.segments:
            lo, hi = t0, min(t1, end)
            if hi <= lo:
                continue
            if kind == "wait":  # waiting for later streams: their exposed transfer + deser
                split = min(max(self.all_arrival_t, lo), hi)
                out["exposed_communication"] += split - lo
                out["deserialize"] += hi - split
            else:
                out[_SEGMENT_PART[kind]] += hi - lo
        return out


def request_row(rec: RequestRecord, ks: list[int], breakdown_k: int) -> dict:
    """One request's metrics. ks beyond the tokens this request decodes are left out (only
    trace files give requests fewer tokens than metrics.ks allows; SimConfig.validate
    refuses a k no request decodes); the breakdown splits TTKT(min(breakdown_k, tokens))."""
    tl = rec.timeline
    token_t, committed_t = tl.token_t, tl.committed_t  # [tokens] s
    tokens = len(token_t)
    ks_ok = [k for k in ks if 1 <= k <= tokens]
    breakdown_k = min(breakdown_k, tokens)
    # TTKT(k) and committed TTKT(k) (s) of the reported ks and of token 1, read once
    # (the values rec.ttkt / rec.ttkt_committed return)
    drafted = {k: float(token_t[k - 1]) for k in ks_ok}
    committed = {k: float(committed_t[k - 1]) for k in ks_ok}
    t1, c1 = float(token_t[0]), float(committed_t[0])
    arrival_t, prefill_end_t = rec.arrival_t, rec.prefill_end_t
    return {
        "ttft_s": t1 - arrival_t,
        "ttft_from_prefill_end_s": t1 - prefill_end_t,
        "ttkt_s": {k: t - arrival_t for k, t in drafted.items()},
        "ttkt_from_prefill_end_s": {k: t - prefill_end_t for k, t in drafted.items()},
        # committed: a token counts when it is verified (drafts wait for verification)
        "ttft_committed_s": c1 - arrival_t,
        "ttft_committed_from_prefill_end_s": c1 - prefill_end_t,
        "ttkt_committed_s": {k: t - arrival_t for k, t in committed.items()},
        "ttkt_committed_from_prefill_end_s": {k: t - prefill_end_t
                                              for k, t in committed.items()},
        "prefill_s": rec.prefill_end_t - rec.prefill_start_t,
        # waited for a prefill node (before the breakdown's window, which starts at prefill end)
        "prefill_wait_s": rec.prefill_start_t - rec.arrival_t,
        "breakdown_k": breakdown_k,
        "breakdown_s": rec.breakdown(breakdown_k),
        # decode admission waited for decode memory (part of the breakdown's queueing)
        "memory_wait_s": float(rec.extra.get("memory_wait_s", 0.0)),
        "proposed_tokens": tl.proposed,
        "accepted_tokens": tl.accepted,
        "tpot_s": tl.tpot_s,
        "anchor_ready_from_prefill_end_s": rec.needed_ready_t - rec.prefill_end_t,
        "full_ready_from_prefill_end_s": rec.full_ready_t - rec.prefill_end_t,
    }


def percentiles(values: list[float] | np.ndarray) -> dict[str, float]:
    v = np.asarray(values, dtype=float)
    if len(v) == 0:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(v.mean())}


# per-request keys averaged into a multi-request row (those every request has)
MEAN_KEYS = ("ttft_s", "ttft_from_prefill_end_s", "ttft_committed_s",
             "ttft_committed_from_prefill_end_s", "prefill_s", "prefill_wait_s",
             "memory_wait_s", "tpot_s")
TTKT_KEYS = ("ttkt_s", "ttkt_from_prefill_end_s", "ttkt_committed_s",
             "ttkt_committed_from_prefill_end_s")


def aggregate_columns(columns: dict[str, Any], ttkt: dict[str, dict[int, Any]],
                      ttkt_requests: dict[int, int], breakdown: dict[str, Any],
                      proposed: int, accepted: int) -> dict:
    """The metrics of a multi-request row from its per-request columns, for the simulator
    and the emulator alike: means of the MEAN_KEYS columns given (the requests' values in
    order), percentiles of TTFT (drafted, committed) and of the waits, TTKT(k) means and
    percentiles over the requests that decode k tokens (ttkt[key][k]: their values;
    `ttkt_requests` counts them), the breakdown's means (breakdown[key]: one value per
    request), summed drafts."""
    out: dict = {key: float(np.mean(column)) for key, column in columns.items()}
    for key in ("ttft_s", "ttft_committed_s", "prefill_wait_s", "memory_wait_s"):
        if key in columns:
            out[key.removesuffix("_s") + "_pct_s"] = percentiles(columns[key])
    out["ttkt_requests"] = ttkt_requests
    for key, by_k in ttkt.items():
        out[key] = {k: float(np.mean(values)) for k, values in by_k.items()}
    for key in ("ttkt_s", "ttkt_committed_s"):  # every row has both (request_row)
        out[key.removesuffix("_s") + "_pct_s"] = {k: percentiles(v) for k, v in ttkt[key].items()}
    out["breakdown_s"] = {key: float(np.mean(breakdown[key])) for key in BREAKDOWN_KEYS}
    out["proposed_tokens"] = int(proposed)
    out["accepted_tokens"] = int(accepted)
    return out


def aggregate_request_rows(per: list[dict]) -> dict:
    """Request rows (request_row, or the transport's measured rows) -> the metrics of a
    multi-request row (aggregate_columns); keys some rows lack are left out."""
    columns = {key: [p[key] for p in per] for key in MEAN_KEYS if all(key in p for p in per)}
    ks = sorted({k for p in per for k in p["ttkt_s"]}, key=int)
    ttkt = {key: {k: [p[key][k] for p in per if k in p[key]] for k in ks}
            for key in TTKT_KEYS if all(key in p for p in per)}
    return aggregate_columns(
        columns, ttkt, {k: sum(k in p["ttkt_s"] for p in per) for k in ks},
        {key: [p["breakdown_s"][key] for p in per] for key in BREAKDOWN_KEYS},
        sum(p["proposed_tokens"] for p in per), sum(p["accepted_tokens"] for p in per))


def aggregate_records(recs: list[RequestRecord], ks: list[int], breakdown_k: int) -> dict:
    """aggregate_request_rows([request_row(r, ks, breakdown_k) for r in recs]), the same
    numbers (the same values in the same order into aggregate_columns), with the columns
    read from the records instead of through a dict per request: those dicts took a tenth
    of a 10,000-request run."""
    arrival = np.array([r.arrival_t for r in recs])
    prefill_end = np.array([r.prefill_end_t for r in recs])
    prefill_start = np.array([r.prefill_start_t for r in recs])
    timelines = [r.timeline for r in recs]
    tokens = np.array([len(tl.token_t) for tl in timelines])
    if recs and (tokens == tokens[0]).all():  # one output length: [n, tokens] matrices
        # one concatenation, not np.stack (a view per row: 5 us per request at 100k)
        shape = (len(timelines), int(tokens[0]))
        drafted = np.concatenate([tl.token_t for tl in timelines]).reshape(shape)
        committed = np.concatenate([tl.committed_t for tl in timelines]).reshape(shape)
    else:
        drafted = committed = None
    t1 = np.array([float(tl.token_t[0]) for tl in timelines])
    c1 = np.array([float(tl.committed_t[0]) for tl in timelines])
    columns = {
        "ttft_s": t1 - arrival,
        "ttft_from_prefill_end_s": t1 - prefill_end,
        "ttft_committed_s": c1 - arrival,
        "ttft_committed_from_prefill_end_s": c1 - prefill_end,
        "prefill_s": prefill_end - prefill_start,
        "prefill_wait_s": prefill_start - arrival,
        "memory_wait_s": np.array([float(r.extra.get("memory_wait_s", 0.0)) for r in recs]),
        "tpot_s": np.array([tl.tpot_s for tl in timelines]),
    }
    ks_seen = sorted({k for k in ks if 1 <= k <= int(tokens.max(initial=0))}, key=int)
    ttkt: dict[str, dict[int, np.ndarray]] = {key: {} for key in TTKT_KEYS}
    for k in ks_seen:
        has = tokens >= k
        if drafted is not None:
            d_k, c_k = drafted[:, k - 1], committed[:, k - 1]
        else:
            d_k = np.array([float(tl.token_t[k - 1])
                            for tl, ok in zip(timelines, has, strict=True) if ok])
            c_k = np.array([float(tl.committed_t[k - 1])
                            for tl, ok in zip(timelines, has, strict=True) if ok])
        a_k, pe_k = arrival[has], prefill_end[has]
        ttkt["ttkt_s"][k] = d_k - a_k
        ttkt["ttkt_from_prefill_end_s"][k] = d_k - pe_k
        ttkt["ttkt_committed_s"][k] = c_k - a_k
        ttkt["ttkt_committed_from_prefill_end_s"][k] = c_k - pe_k
    # the breakdown splits TTKT(min(breakdown_k, tokens)) of each request
    if drafted is not None:
        end_t = drafted[:, min(breakdown_k, int(tokens[0])) - 1].copy()
    else:
        end_t = np.array([float(tl.token_t[min(breakdown_k, len(tl.token_t)) - 1])
                          for tl in timelines])
    return aggregate_columns(
        {key: columns[key] for key in MEAN_KEYS}, ttkt,
        {k: int((tokens >= k).sum()) for k in ks_seen},
        breakdown_columns(recs, end_t),
        sum(tl.proposed for tl in timelines), sum(tl.accepted for tl in timelines))


# a decode segment's kind -> its code in breakdown_columns: -1 wait, else its part's
# BREAKDOWN_KEYS index
_SEGMENT_CODE = {"wait": -1} | {kind: BREAKDOWN_KEYS.index(part)
                                for kind, part in _SEGMENT_PART.items()}


def breakdown_columns(recs: list[RequestRecord], end_t: np.ndarray) -> dict[str, np.ndarray]:
    """[RequestRecord.breakdown] over many records at once, as columns: [n] s per part,
    splitting [prefill end, end_t[i]]. For finite times (a run's records), the same floats as
    the per-record method: the same operations, each record's segments added in their order
    (np.add.at is sequential); np.minimum / np.maximum differ from min / max only on NaN and
    on ties of opposite-signed zeros. Without the per-record dict and loop (a quarter of a
    100k-request row)."""
    n = len(recs)
    t_pe = np.array([r.prefill_end_t for r in recs])
    arrival = np.array([r.needed_arrival_t for r in recs])
    exposed = np.maximum(arrival - t_pe, 0.0)
    serialize = np.minimum(exposed, np.maximum(
        np.array([r.needed_backlog_t for r in recs]) - t_pe, 0.0))
    ready = np.array([r.needed_ready_t for r in recs])
    out = {key: np.zeros(n) for key in BREAKDOWN_KEYS}
    out["serialize"] = serialize
    out["exposed_communication"] = exposed - serialize
    out["deserialize"] = ready - np.maximum(arrival, t_pe)
    out["queueing"] = np.array([r.decode_start_t for r in recs]) - ready
    segments = [r.timeline.segments for r in recs]
    flat = list(chain.from_iterable(segments))  # (kind, t0, t1), record by record
    if not flat:
        return out
    owner = np.repeat(np.arange(n), [len(seg) for seg in segments])  # [m] record index
    kinds, t0, t1 = zip(*flat, strict=True)
    code = np.array([_SEGMENT_CODE[kind] for kind in kinds])  # [m]
    lo = np.array(t0)
    hi = np.minimum(np.array(t1), end_t[owner])
    live = hi > lo  # [m] the segment overlaps [.., end]
    wait = live & (code == -1)
    if wait.any():  # waiting for later streams: their exposed transfer, then deserialization
        i, w_lo, w_hi = owner[wait], lo[wait], hi[wait]
        split = np.minimum(np.maximum(np.array([r.all_arrival_t for r in recs])[i], w_lo),
                           w_hi)
        np.add.at(out["exposed_communication"], i, split - w_lo)
        np.add.at(out["deserialize"], i, w_hi - split)
    for part in set(_SEGMENT_CODE.values()) - {-1}:
        mask = live & (code == part)
        np.add.at(out[BREAKDOWN_KEYS[part]], owner[mask], (hi - lo)[mask])
    return out
