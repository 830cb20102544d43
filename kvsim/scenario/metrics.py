"""Per-request outcomes, the Figure-2 breakdown, and multi-request aggregates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from kvsim.scenario.speculative import DecodeTimeline

BREAKDOWN_KEYS = ("serialize", "exposed_communication", "deserialize", "queueing", "decode",
                  "rejected_speculative", "verification")
# the breakdown part a decode timeline segment counts towards ("wait": see breakdown)
_SEGMENT_PART: dict[str, str] = {
    "draft_accepted": "decode", "draft_rejected": "rejected_speculative",
    "verify": "verification", "decode": "decode"}


@dataclass(slots=True)  # slots: a 100,000-request run keeps 100,000 of them
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
        return self.timeline.committed_at(k)

    def breakdown(self, k: int) -> dict[str, float]:
        """Split [prefill end, TTKT(k)] along the critical path; the parts sum to it.

        Transfer: the needed flow's last byte arrived at needed_arrival_t; walking back, its
        flow had bytes queued on the link without a break since needed_backlog_t (the
        release of the message that found the flow empty). Before that instant the flow
        waited for the transfer's handshake and the encoder (serialize), after it for the
        link (exposed communication: its own bytes, others' ahead of it, latency).
        Monolithic: everything is released at the end of encoding, so serialize is the
        whole encode after prefill; pipelined with an encoder slower than the link: the last
        chunk found the flow empty, so serialize is the encoding up to it and communication
        only its transfer."""
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
    token_t = tl.token_t  # [tokens] s
    tokens = len(token_t)
    ks_ok = [k for k in ks if 1 <= k <= tokens]
    breakdown_k = min(breakdown_k, tokens)
    # TTKT(k) and committed TTKT(k) (s) of the reported ks and of token 1, read once
    # (the values rec.ttkt / rec.ttkt_committed return)
    drafted = {k: float(token_t[k - 1]) for k in ks_ok}
    committed = {k: tl.committed_at(k) for k in ks_ok}
    t1, c1 = float(token_t[0]), tl.committed_at(1)
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
        # the first draft step's end (nan where the request did not draft)
        "first_draft_from_prefill_end_s": tl.first_draft_t - prefill_end_t,
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
    percentiles over the requests that decode k tokens (`ttkt[key][k]`: their values;
    `ttkt_requests` counts them), the breakdown's means (`breakdown[key]`: one value per
    request), summed drafts."""
    out: dict = {key: float(np.mean(column)) for key, column in columns.items()}
    for key in ("ttft_s", "ttft_committed_s", "prefill_wait_s", "memory_wait_s", "tpot_s"):
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


# the per-request scalars record_columns reads, in its one pass (a column each)
_SCALARS = ("arrival_t", "prefill_start_t", "prefill_end_t", "needed_arrival_t",
            "needed_backlog_t", "needed_ready_t", "all_arrival_t", "decode_start_t",
            "context_tokens", "memory_wait_s", "tokens", "first_token_t",
            "commit_count", "commit_t", "last_token_t", "tpot_s", "proposed", "accepted",
            "total_bytes")


@dataclass
class RecordColumns:
    """Many records as columns, read in one pass over them: at 100,000 records (~2.3 KB
    each, spread over the heap) every pass is mostly cache misses, so one pass per column
    would cost the multi-request row far more than its share at 10,000."""
    scalars: dict[str, np.ndarray]  # _SCALARS -> [n] (float64; counts exact below 2^53)
    stream_bytes: np.ndarray  # [n, streams] wire bytes per stream (float64, as the scalars)
    token_t: list[np.ndarray]  # [n] each record's drafted token times (s)
    segments: list[list[tuple[str, float, float]]]  # [n] each timeline's segments


def record_columns(recs: list[RequestRecord]) -> RecordColumns:
    n, width = len(recs), len(_SCALARS)
    streams = len(recs[0].stream_bytes) if recs else 0
    values = np.empty((n, width))
    stream_bytes = np.empty((n, streams))
    token_t, segments = [], []
    for i, r in enumerate(recs):
        tl = r.timeline
        drafted = tl.token_t
        values[i] = (r.arrival_t, r.prefill_start_t, r.prefill_end_t, r.needed_arrival_t,
                     r.needed_backlog_t, r.needed_ready_t, r.all_arrival_t, r.decode_start_t,
                     r.context_tokens, r.extra.get("memory_wait_s", 0.0), len(drafted),
                     drafted[0], tl.commit_count, tl.commit_t, drafted[-1], tl.tpot_s,
                     tl.proposed, tl.accepted, sum(r.stream_bytes))
        stream_bytes[i] = r.stream_bytes
        token_t.append(drafted)
        segments.append(tl.segments)
    return RecordColumns(dict(zip(_SCALARS, values.T, strict=True)), stream_bytes, token_t,
                         segments)


def committed_column(col: dict[str, np.ndarray], k: int, drafted_k: np.ndarray,
                     rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """Committed TTKT(k) times (s) of the records `rows` from their drafted ones
    (DecodeTimeline.committed_at, per column)."""
    return np.where(k <= col["commit_count"][rows], col["commit_t"][rows], drafted_k)


def aggregate_records(recs: list[RequestRecord], ks: list[int], breakdown_k: int,
                      cols: RecordColumns | None = None) -> dict:
    """aggregate_request_rows([request_row(r, ks, breakdown_k) for r in recs]), the same
    numbers (the same values in the same order into aggregate_columns), with the columns
    read from the records (record_columns; `cols` if the caller has them) instead of
    through a dict per request: those dicts took a tenth of a 10,000-request run."""
    c = record_columns(recs) if cols is None else cols
    col = c.scalars
    arrival, prefill_end = col["arrival_t"], col["prefill_end_t"]
    tokens = col["tokens"].astype(np.int64)
    if recs and (tokens == tokens[0]).all():  # one output length: [n, tokens] matrices
        # one concatenation, not np.stack (which makes a view per row)
        drafted = np.concatenate(c.token_t).reshape(len(recs), int(tokens[0]))
    else:
        drafted = None
    t1 = col["first_token_t"]
    c1 = committed_column(col, 1, t1)
    columns = {
        "ttft_s": t1 - arrival,
        "ttft_from_prefill_end_s": t1 - prefill_end,
        "ttft_committed_s": c1 - arrival,
        "ttft_committed_from_prefill_end_s": c1 - prefill_end,
        "prefill_s": prefill_end - col["prefill_start_t"],
        "prefill_wait_s": col["prefill_start_t"] - arrival,
        "memory_wait_s": col["memory_wait_s"],
        "tpot_s": col["tpot_s"],
    }
    ks_seen = sorted({k for k in ks if 1 <= k <= int(tokens.max(initial=0))}, key=int)
    ttkt: dict[str, dict[int, np.ndarray]] = {key: {} for key in TTKT_KEYS}
    for k in ks_seen:
        has = tokens >= k
        if drafted is not None:
            d_k = drafted[:, k - 1]
        else:
            d_k = np.array([float(t[k - 1]) for t, ok in zip(c.token_t, has, strict=True) if ok])
        c_k = committed_column(col, k, d_k, has)
        a_k, pe_k = arrival[has], prefill_end[has]
        ttkt["ttkt_s"][k] = d_k - a_k
        ttkt["ttkt_from_prefill_end_s"][k] = d_k - pe_k
        ttkt["ttkt_committed_s"][k] = c_k - a_k
        ttkt["ttkt_committed_from_prefill_end_s"][k] = c_k - pe_k
    # the breakdown splits TTKT(min(breakdown_k, tokens)) of each request
    if drafted is not None:
        end_t = drafted[:, min(breakdown_k, int(tokens[0])) - 1].copy()
    else:
        end_t = np.array([float(t[min(breakdown_k, len(t)) - 1]) for t in c.token_t])
    return aggregate_columns(
        {key: columns[key] for key in MEAN_KEYS}, ttkt,
        {k: int((tokens >= k).sum()) for k in ks_seen},
        breakdown_columns(recs, end_t, c),
        int(col["proposed"].sum()), int(col["accepted"].sum()))


# a decode segment's kind -> its code in breakdown_columns: -1 wait, else its part's
# BREAKDOWN_KEYS index
_SEGMENT_CODE = {"wait": -1} | {kind: BREAKDOWN_KEYS.index(part)
                                for kind, part in _SEGMENT_PART.items()}


def breakdown_columns(recs: list[RequestRecord], end_t: np.ndarray,
                      cols: RecordColumns | None = None) -> dict[str, np.ndarray]:
    """[RequestRecord.breakdown] over many records at once, as columns: [n] s per part,
    splitting [prefill end, end_t[i]]. For finite times (a run's records), the same floats as
    the per-record method: the same operations, each record's segments added in their order
    (np.add.at is sequential); np.minimum / np.maximum differ from min / max only on NaN and
    on ties of opposite-signed zeros. Without the per-record dict and loop (a quarter of a
    100k-request row). `cols`: the records' record_columns, if the caller has them."""
    c = record_columns(recs) if cols is None else cols
    col = c.scalars
    n = len(recs)
    t_pe = col["prefill_end_t"]
    arrival = col["needed_arrival_t"]
    exposed = np.maximum(arrival - t_pe, 0.0)
    serialize = np.minimum(exposed, np.maximum(col["needed_backlog_t"] - t_pe, 0.0))
    ready = col["needed_ready_t"]
    out = {key: np.zeros(n) for key in BREAKDOWN_KEYS}
    out["serialize"] = serialize
    out["exposed_communication"] = exposed - serialize
    out["deserialize"] = ready - np.maximum(arrival, t_pe)
    out["queueing"] = col["decode_start_t"] - ready
    segments = c.segments
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
        split = np.minimum(np.maximum(col["all_arrival_t"][i], w_lo), w_hi)
        np.add.at(out["exposed_communication"], i, split - w_lo)
        np.add.at(out["deserialize"], i, w_hi - split)
    for part in set(_SEGMENT_CODE.values()) - {-1}:
        mask = live & (code == part)
        np.add.at(out[BREAKDOWN_KEYS[part]], owner[mask], (hi - lo)[mask])
    return out
