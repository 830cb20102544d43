"""Workloads from request traces: a CSV of arrival time, context tokens and output tokens,
with the columns of the public Azure LLM inference traces (TIMESTAMP, ContextTokens,
GeneratedTokens). TIMESTAMP is a date-time (as in those traces) or a number of seconds;
arrivals are taken relative to the first row. Rows must be in time order (the traces are);
an unsorted, empty or non-numeric file is refused with the row that is wrong.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class RequestTrace:
    arrival_s: np.ndarray  # [n] float, from the first request
    context_tokens: np.ndarray  # [n] int >= 1
    output_tokens: np.ndarray  # [n] int >= 1
    source: str  # the file


def load_request_trace(path: str | Path, max_requests: int = 0,
                       time_scale: float = 1.0) -> RequestTrace:
    """Read a trace CSV (first `max_requests` rows when > 0); arrival gaps are multiplied by
    `time_scale` (0.5 replays it twice as fast)."""
    import pandas as pd

    path = Path(path)
    try:
        table = pd.read_csv(path, nrows=max_requests or None)
    except (OSError, ValueError) as exc:
        raise ValueError(f"workload trace {path}: cannot read it as CSV ({exc})") from exc
    from kvsim.core.data_files import record_loaded

    record_loaded(path)  # provenance: path and sha256 in every report
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"workload trace {path}: missing column(s) {missing}; expected "
                         f"{list(COLUMNS)} (the Azure LLM inference trace format)")
    if table.empty:
        raise ValueError(f"workload trace {path}: no requests")
    if not time_scale > 0:
        raise ValueError(f"workload.trace_time_scale must be > 0, got {time_scale!r}")
    stamps = table["TIMESTAMP"]
    if pd.api.types.is_numeric_dtype(stamps):
        t = stamps.to_numpy(dtype=float)
    else:
        try:
            when = pd.to_datetime(stamps)
            t = (when - when.iloc[0]).dt.total_seconds().to_numpy(dtype=float)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"workload trace {path}: TIMESTAMP is neither seconds nor a "
                             f"date-time ({exc})") from exc
    if not np.isfinite(t).all():
        raise ValueError(f"workload trace {path}: TIMESTAMP row {int(np.argmin(np.isfinite(t)))}"
                         " is not a finite time")
    back = np.nonzero(np.diff(t) < 0)[0]
    if back.size:
        raise ValueError(f"workload trace {path}: TIMESTAMP goes back in time at row "
                         f"{int(back[0]) + 1}; sort the file by time")
    counts = {}
    for col in COLUMNS[1:]:
        v = pd.to_numeric(table[col], errors="coerce").to_numpy(dtype=float)
        bad = np.nonzero(~np.isfinite(v) | (v < 1) | (v != np.round(v)))[0]
        if bad.size:
            raise ValueError(f"workload trace {path}: {col} row {int(bad[0])} is "
                             f"{table[col].iloc[int(bad[0])]!r}, not an integer >= 1")
        counts[col] = v.astype(np.int64)
    return RequestTrace((t - t[0]) * time_scale, counts["ContextTokens"],
                        counts["GeneratedTokens"], str(path))


@functools.lru_cache(maxsize=8)
def cached_request_trace(path: str, max_requests: int, time_scale: float) -> RequestTrace:
    """load_request_trace, read once per process (config validation asks repeatedly)."""
    return load_request_trace(path, max_requests, time_scale)
