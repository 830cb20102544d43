"""An emulated request's report row: the simulator's `RequestRecord` filled with measured times,
so `kvsim emulate` and `kvsim sim` rows carry the same fields computed by the same code
(TTFT, TTKT from arrival and from prefill end, the Figure-2 breakdown, bytes, drafts), plus
what only a real run has: committed-token times, goodput, refused frames, token ids.

All times in the inputs are Unix seconds; rows hold durations (s) from request arrival
(`*_s`) or from prefill end (`*_from_prefill_end_s`), as the simulator's rows do.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvsim.scenario.metrics import RequestRecord, aggregate_request_rows, request_row
from kvsim.scenario.speculative import DecodeTimeline, commit_head
from kvsim.transport import protocol as P
from kvsim.transport.assembly import Assembly

_BREAKDOWN_KINDS = ("draft_accepted", "draft_rejected", "wait", "verify", "decode")


def _num(doc: dict | None, key: str, default: float = math.nan) -> float:
    value = (doc or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else default


def emulated_row(asm: Assembly, hello: dict, result: Any, error: str,
                 extra: dict | None = None) -> dict:
    """The row of one request (result: a DecodeResult, or None when it failed)."""
    arrival = _num(hello, "arrival_t")
    prefill_end = _num(hello, "prefill_end_t")
    stream_bytes = list(asm.table.stream_bytes)
    stream_bytes[0] += asm.table.header_bytes  # the preamble travels with stream 0 (as in sim)
    base: dict[str, Any] = {
        "mode": "emulated", "request_id": P.id_hex(asm.request_id),
        "variant": hello.get("variant"), "seq": hello.get("seq"), "model": hello.get("model"),
        "codec": hello.get("codec_label", asm.codec.name), "codec_name": asm.codec.name,
        "transfer": hello.get("policy"), "streams": asm.num_streams,
        "context_tokens": asm.shape.tokens,
        "bandwidth_gbps": _num(hello, "bandwidth_gbps"),
        "link_emulation": hello.get("link_emulation"), "kv_source": hello.get("kv_source"),
        "prefill_measured": bool(hello.get("prefill_measured")),
        "stream_bytes": dict(zip(asm.codec.stream_names(), stream_bytes, strict=True)),
        "total_bytes": asm.table.total_bytes, "exact_sizes": asm.table.exact,
        "refused_frames": dict(asm.refused), "dequantize": asm.dequantize,
        **asm.received_summary(), **(extra or {}),
    }
    if result is None:
        base.update(status="partial" if asm.arrived_streams() < asm.num_streams else "error",
                    error=error)
        return base
    streams = asm.streams
    speculative = result.proposed > 0 or (
        str(hello.get("policy", "")).startswith("split_stream") and asm.num_streams > 1)
    needed = streams[:1] if speculative else streams
    last_needed = max(range(len(needed)), key=lambda i: needed[i].last_arrival_t)
    fin = asm.fin or {}
    backlog = (fin.get("backlog_start_t") or {}).get(str(last_needed))
    needed_arrival = needed[last_needed].last_arrival_t
    all_arrival = max(s.last_arrival_t for s in streams)
    segments = []
    for kind, t0, t1 in result.segments:
        if kind == "dequantize":  # before decoding began it is in needed_ready_t already;
            if t0 < result.start_t - 1e-9:  # after (the full cache, while drafts wait for
                continue  # verification), it is the simulator's 'wait' for later streams
            kind = "wait"
        if kind in _BREAKDOWN_KINDS:
            segments.append((kind, t0, t1))
    drafted = np.asarray(result.drafted_t, dtype=float)
    # committed: verified (or decoded) times, a leading run at the end of verification
    commit_count, commit_t = commit_head(drafted, np.asarray(result.committed_t, dtype=float))
    timeline = DecodeTimeline(
        drafted, result.start_t, result.full_t,
        result.proposed, result.accepted, result.verify_start_t,
        (result.verify_end_t - result.verify_start_t) if result.proposed else 0.0,
        getattr(result, "draft_tpot_s", 0.0), result.tpot_s, segments, commit_count, commit_t,
        float(result.draft_step_t[0]) if result.proposed and result.draft_step_t else math.nan)
    rec = RequestRecord(
        int(hello.get("seq") or 0), asm.shape.tokens, arrival,
        _num(hello, "prefill_start_t"), prefill_end, _num(fin, "encode_end_t", prefill_end),
        needed_arrival, float(backlog) if isinstance(backlog, (int, float)) else prefill_end,
        result.start_t, all_arrival, result.full_t, result.start_t, timeline, stream_bytes,
        float(sum(s.bytes for s in streams)) + asm.table.header_bytes,
        hello.get("policy") == "monolithic")
    ks = [int(k) for k in hello.get("ks") or [] if 1 <= int(k) <= len(result.drafted_t)]
    bk = int(hello.get("breakdown_k") or min(32, len(result.drafted_t)))
    row = {**base, **request_row(rec, ks, min(bk, len(result.drafted_t)))}
    first_send = _num(fin, "first_send_t", prefill_end)
    wire_s = all_arrival - first_send
    row.update({
        "status": "done" if not error else "error", "error": error,
        "decode": result.mode,
        # the sender's encoder at work (s, over the layers; FIN): calibration's encode rate
        "encode_work_s": _num(fin, "encode_work_s"),
        "handshake_s": handshake_s(fin),
        "stream_complete_from_prefill_end_s": {
            name: float(s.complete_t - prefill_end)
            for name, s in zip(asm.codec.stream_names(), streams, strict=True)},
        "goodput_gbps": 8.0 * sum(s.bytes for s in streams) / wire_s / 1e9
        if wire_s > 0 else math.nan,
        "token_ids": list(result.token_ids),
        "drafted_from_arrival_s": [float(t - arrival) for t in result.drafted_t],
        # every draft step's end, the rejected ones' too (each draft step's length beside
        # the worker's jobs; the draft fit, kvsim.calibrate.draft_ingest, replays the
        # drafting window's spans)
        "draft_steps_from_arrival_s": [float(t - arrival) for t in result.draft_step_t],
        "committed_from_arrival_s": [float(t - arrival) for t in result.committed_t],
        "trace_spans": trace_spans(asm, hello, result, fin),
    })
    scale = _num(hello, "time_scale", 1.0)
    return slowed_down(row, scale, arrival) if scale != 1 else row


REAL_TIME_KEYS = ("encode_work_s", "handshake_s")  # slowed_down leaves them as they ran


def handshake_s(fin: dict) -> float:
    """What a transfer's start costs beyond its encoding (s; NaN where the FIN lacks the
    times): from the sender's HELLO (made when the prefill ends, or when it starts for a
    modelled prefill the transfer runs with) to the encoder's start (the receiver admitting
    the request, its ACCEPT back), plus from the first chunk's release to its send (the
    hand-off to the link loop, a thread of the same process). The link profile's
    `handshake_s` (kvsim.calibrate.link_profile.handshake_entry) is its median over
    calibration transfers."""
    start = _num(fin, "encode_start_t") - _num(fin, "hello_start_t")
    hand_off = _num(fin, "first_send_t") - _num(fin, "first_release_t")
    return float(start + hand_off)


def slowed_down(row: dict, k: float, arrival_t: float) -> dict:
    """A row of a run whose link and modelled times were k times slower, in real time:
    every duration (`*_s` fields, their dicts and lists) / k, goodput * k, trace spans
    shrunk k-fold around the arrival. The row keeps `time_scale: k`."""
    def scaled(v: Any) -> Any:
        if isinstance(v, dict):
            return {key: scaled(x) for key, x in v.items()}
        if isinstance(v, list):
            return [scaled(x) for x in v]
        return v / k if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    # the encoder's work and the handshake ran at real speed (only the link and the
    # modelled times were slowed): as measured
    out = {key: scaled(v) if key.endswith("_s") and key not in REAL_TIME_KEYS else v
           for key, v in row.items()}
    out["goodput_gbps"] = row["goodput_gbps"] * k
    out["trace_spans"] = [[n, p, arrival_t + (a - arrival_t) / k, arrival_t + (b - arrival_t) / k]
                          for n, p, a, b in row["trace_spans"]]
    out["time_scale"] = k
    return out


def trace_spans(asm: Assembly, hello: dict, result: Any, fin: dict) -> list[list]:
    """[name, process, t0_unix_s, t1_unix_s] spans of one request, named like the
    simulator's trace (prefill, encode, transfer <stream>, deserialize, decode kinds) so the
    simulated and the real timeline can be laid side by side."""
    t_p0, t_pe = _num(hello, "prefill_start_t"), _num(hello, "prefill_end_t")
    out: list[list] = [["prefill", "prefill", t_p0, t_pe],
                       ["encode", "prefill", t_pe, _num(fin, "encode_end_t", t_pe)]]
    first_send = _num(fin, "first_send_t", t_pe)
    for name, st in zip(asm.codec.stream_names(), asm.streams, strict=True):
        out.append([f"transfer {name}", "link", first_send, st.complete_t])
    layer_spans = asm.dequantizer.spans if asm.dequantizer is not None else []
    for name, t0, t1 in [*asm.events, *layer_spans, *result.events]:
        if name.startswith("dequantize"):
            out.append([name, "decode", t0, t1])
    for kind, t0, t1 in result.segments:
        if kind != "dequantize":
            out.append([kind, "decode", t0, t1])
    return [s for s in out if math.isfinite(s[2]) and math.isfinite(s[3]) and s[3] >= s[2]]


def aggregate_rows(rows: list[dict]) -> list[dict]:
    """One row per (codec, transfer) as `kvsim sim` writes for a multi-request workload:
    means over requests, TTFT / TTKT percentiles (drafted and committed), summed drafts; the
    request rows are kept under `per_request`. Groups of one request are returned as they are.
    Failed requests are counted (`failed_requests`), never averaged in."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("codec"), r.get("transfer")), []).append(r)
    out = []
    for group in groups.values():
        done = [r for r in group if r.get("status") == "done"]
        if len(group) == 1 or not done:
            out.extend(group)
            continue
        first = done[0]
        row = {k: v for k, v in first.items() if not isinstance(v, (dict, list))}
        row.update(requests=len(done), failed_requests=len(group) - len(done),
                   request_id=None, per_request=group)
        row.update(aggregate_request_rows(done))
        for key in ("goodput_gbps", "total_bytes"):
            row[key] = float(np.mean([r[key] for r in done]))
        row["context_tokens_mean"] = float(np.mean([r["context_tokens"] for r in done]))
        # contexts may differ between requests: mean bytes per stream, as the simulator
        row["stream_bytes"] = {name: float(np.mean([r["stream_bytes"][name] for r in done]))
                               for name in first["stream_bytes"]}
        out.append(row)
    return out
