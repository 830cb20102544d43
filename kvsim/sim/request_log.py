"""Per-request results of a simulation (`requests_path=`): one row per request of every
scenario and sample, every phase's start and end, TTFT / TTKT drafted and committed, bytes,
drafts. Times in seconds on the simulation clock (t = 0 is the first arrival's origin);
durations are `*_s` from the request's arrival unless named `*_from_prefill_end_s`.
Written as Parquet (or CSV when the path ends in .csv) once every scenario has run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsim.scenario.metrics import RequestRecord

PHASES = ("arrival_t", "prefill_start_t", "prefill_end_t", "encode_end_t",
          "needed_arrival_t", "needed_ready_t", "all_arrival_t", "full_ready_t",
          "decode_start_t")


# tokens whose KV was sent, of the prompt its decode / prefill instance held, fetched from
# the shared store
PREFIX_KEYS = ("sent_tokens", "prefix_hit_tokens", "prefill_hit_tokens", "store_hit_tokens")


def request_rows(records: list[RequestRecord], ks: list[int], scenario: dict[str, Any]
                 ) -> list[dict[str, Any]]:
    """Flat rows (scenario keys first) for the records of one run."""
    rows = []
    for rec in sorted(records, key=lambda r: r.seq):
        tl = rec.timeline
        row: dict[str, Any] = {**scenario, "request": rec.seq,
                               "context_tokens": rec.context_tokens}
        row.update({name: float(getattr(rec, name)) for name in PHASES})
        row.update({
            "first_token_t": rec.ttkt(1), "last_token_t": float(tl.token_t[-1]),
            "verify_start_t": float(tl.verify_start_t), "verify_s": float(tl.verify_s),
            "ttft_s": rec.ttkt(1) - rec.arrival_t,
            "ttft_committed_s": rec.ttkt_committed(1) - rec.arrival_t,
            "ttft_from_prefill_end_s": rec.ttkt(1) - rec.prefill_end_t,
            "queueing_s": rec.decode_start_t - rec.needed_ready_t,
            "memory_wait_s": float(rec.extra.get("memory_wait_s", 0.0)),
            "decode_kv_bytes": float(rec.extra.get("decode_kv_bytes", 0.0)),
            "prefill_wait_s": rec.prefill_start_t - rec.arrival_t,
            "total_bytes": int(sum(rec.stream_bytes)),
            "received_bytes": float(rec.received_bytes),
            "proposed_tokens": tl.proposed, "accepted_tokens": tl.accepted,
            "tpot_s": float(tl.tpot_s),
        })
        for i, b in enumerate(rec.stream_bytes):
            row[f"stream{i}_bytes"] = int(b)
        for key in PREFIX_KEYS:  # prefix reuse (prefix_cache.enabled) only
            if key in rec.extra:
                row[key] = int(rec.extra[key])
        tokens = len(tl.token_t)
        row["output_tokens"] = tokens
        for k in ks:  # NaN: this request decodes fewer than k tokens (trace files)
            row[f"ttkt_s.{k}"] = rec.ttkt(k) - rec.arrival_t if k <= tokens else float("nan")
            row[f"ttkt_committed_s.{k}"] = rec.ttkt_committed(k) - rec.arrival_t \
                if k <= tokens else float("nan")
        rows.append(row)
    return rows


def write_request_log(rows: list[dict[str, Any]], path: str | Path) -> Path:
    import pandas as pd

    path = Path(path)
    if path.suffix not in (".parquet", ".csv"):
        raise ValueError(f"requests_path must end in .parquet or .csv, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    if path.suffix == ".csv":
        table.to_csv(path, index=False)
    else:
        table.to_parquet(path, index=False)
    return path
