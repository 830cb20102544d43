"""Workloads from request traces, by path or by the name of a shipped trace (data/traces/).

Three formats:
- CSV with the columns of the public Azure LLM inference traces (TIMESTAMP, ContextTokens,
  GeneratedTokens). TIMESTAMP is a date-time (as in those traces) or a number of seconds.
- CSV with BurstGPT's columns (Timestamp in seconds, Request tokens, Response tokens; Model,
  Total tokens and Log Type are not read). Its failed requests (Response tokens 0) are left
  out, as the trace's `without_fails` files leave them out.
- Mooncake JSONL (`.jsonl`, or gzipped `.jsonl.gz`), one request per line: `timestamp` (ms),
  `input_length` and `output_length` (tokens) and `hash_ids` (the ids of its prefix blocks,
  equal ids at the same position meaning the same prefix: kvsim.scenario.prefix_cache).

Arrivals are taken relative to the first request replayed. Requests must be in time order
(the traces are); an unsorted, empty or malformed file is refused with the row that is wrong.
A replay (`replay`) takes a window of the trace's time, then its first N requests, then
scales the gaps between arrivals.
"""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.core.paths import DATA_DIR

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")  # -> COLUMNS
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
TRACE_DIR = DATA_DIR / "traces"  # shipped traces, by name: <name>.jsonl.gz | .jsonl | .csv
_SUFFIXES = (".jsonl.gz", ".jsonl", ".csv")


@dataclass(frozen=True)
class RequestTrace:
    arrival_s: np.ndarray  # [n] float, from the first request
    context_tokens: np.ndarray  # [n] int >= 1
    output_tokens: np.ndarray  # [n] int >= 1
    source: str  # the file
    # [n] each request's prefix block ids (Mooncake hash_ids); None: the format has none
    prefix_blocks: tuple[tuple[int, ...], ...] | None = None


def trace_file(name_or_path: str) -> Path:
    """The file of a trace named by a path, or by a shipped trace's name (data/traces/)."""
    given = Path(name_or_path).expanduser()
    if given.is_file():
        return given
    if "/" not in name_or_path:
        for suffix in ("", *_SUFFIXES):
            shipped = TRACE_DIR / f"{name_or_path}{suffix}"
            if shipped.is_file() and shipped.name.endswith(_SUFFIXES):
                return shipped
    have = sorted({p.name.split(".")[0] for p in TRACE_DIR.glob("*")
                   if p.name.endswith(_SUFFIXES)})
    raise ValueError(f"workload trace {name_or_path!r} not found: neither a file nor a "
                     f"shipped trace (data/traces/: {', '.join(have) or 'none'})")


def read_trace(path: str | Path) -> RequestTrace:
    """Every request of a trace file (format by suffix: .csv, .jsonl, .jsonl.gz)."""
    path = trace_file(str(path))
    from kvsim.core.data_files import record_loaded

    if path.name.endswith((".jsonl", ".jsonl.gz")):
        trace = _read_mooncake(path)
    else:
        trace = _read_csv(path)
    record_loaded(path)  # provenance: path and sha256 in every report
    return trace


def replay(trace: RequestTrace, start_s: float = 0.0, duration_s: float = 0.0,
           max_requests: int = 0, time_scale: float = 1.0) -> RequestTrace:
    """The requests arriving in [start_s, start_s + duration_s) of the trace (duration 0:
    to its end), the first `max_requests` of them (0: all), arrival gaps x `time_scale`
    (0.5 replays at twice the rate), from the first of them."""
    if not time_scale > 0:
        raise ValueError(f"workload.trace_time_scale must be > 0, got {time_scale!r}")
    if not start_s >= 0 or not duration_s >= 0:
        raise ValueError(f"workload.trace_start_s and trace_duration_s must be >= 0, got "
                         f"{start_s!r} and {duration_s!r}")
    t = trace.arrival_s
    keep = t >= start_s
    if duration_s > 0:
        keep &= t < start_s + duration_s
    rows = np.nonzero(keep)[0]
    if max_requests > 0:
        rows = rows[:max_requests]
    if rows.size == 0:
        raise ValueError(f"workload trace {trace.source}: no request arrives in "
                         f"[{start_s}, {start_s + duration_s if duration_s else 'end'}) s "
                         f"(the trace spans 0 to {float(t[-1]):.3f} s)")
    kept = t[rows]
    blocks = None if trace.prefix_blocks is None else \
        tuple(trace.prefix_blocks[i] for i in rows.tolist())
    return RequestTrace((kept - kept[0]) * time_scale, trace.context_tokens[rows],
                        trace.output_tokens[rows], trace.source, blocks)


def load_request_trace(path: str | Path, max_requests: int = 0,
                       time_scale: float = 1.0) -> RequestTrace:
    """A trace file's first `max_requests` requests (0: all), arrival gaps x `time_scale`."""
    return replay(read_trace(path), max_requests=max_requests, time_scale=time_scale)


def workload_trace(cfg: Any) -> RequestTrace:
    """The requests a WorkloadConfig's trace file gives (read once per process)."""
    return cached_request_trace(cfg.trace_path, float(cfg.trace_start_s),
                                float(cfg.trace_duration_s), int(cfg.trace_max_requests),
                                float(cfg.trace_time_scale))


@functools.lru_cache(maxsize=8)
def cached_request_trace(path: str, start_s: float, duration_s: float, max_requests: int,
                         time_scale: float) -> RequestTrace:
    """replay(read_trace(path), ...), read once per process (config validation asks
    repeatedly)."""
    return replay(_cached_read(path), start_s, duration_s, max_requests, time_scale)


@functools.lru_cache(maxsize=4)
def _cached_read(path: str) -> RequestTrace:
    return read_trace(path)


def _read_mooncake(path: Path) -> RequestTrace:
    opener = gzip.open if path.name.endswith(".gz") else open
    stamps: list[float] = []
    counts: dict[str, list[int]] = {"input_length": [], "output_length": []}
    blocks: list[tuple[int, ...]] = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"workload trace {path}: line {i}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where} is not JSON ({exc})") from None
                if not isinstance(row, dict) or any(k not in row for k in MOONCAKE_KEYS):
                    raise ValueError(f"{where}: needs the keys {list(MOONCAKE_KEYS)} (the "
                                     "Mooncake trace format)")
                t = row["timestamp"]
                if isinstance(t, bool) or not isinstance(t, (int, float)) or \
                        not np.isfinite(t) or t < 0:
                    raise ValueError(f"{where}: timestamp {t!r} is not a time >= 0 (ms)")
                if stamps and t / 1e3 < stamps[-1]:
                    raise ValueError(f"{where}: timestamp goes back in time; sort the file "
                                     "by time")
                stamps.append(t / 1e3)
                for key, out in counts.items():
                    v = row[key]
                    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                        raise ValueError(f"{where}: {key} {v!r} is not an integer >= 1")
                    out.append(v)
                ids = row["hash_ids"]
                if not isinstance(ids, list) or any(
                        isinstance(h, bool) or not isinstance(h, int) for h in ids):
                    raise ValueError(f"{where}: hash_ids must be a list of integers")
                blocks.append(tuple(ids))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"workload trace {path}: cannot read it ({exc})") from exc
    if not stamps:
        raise ValueError(f"workload trace {path}: no requests")
    t = np.asarray(stamps)
    return RequestTrace(t - t[0], np.asarray(counts["input_length"], dtype=np.int64),
                        np.asarray(counts["output_length"], dtype=np.int64), str(path),
                        tuple(blocks))


def _read_csv(path: Path) -> RequestTrace:
    import pandas as pd

    try:
        table = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"workload trace {path}: cannot read it as CSV ({exc})") from exc
    named = dict(zip(COLUMNS, COLUMNS, strict=True))  # ours -> the file's, for messages
    if all(c in table.columns for c in BURSTGPT_COLUMNS) and \
            not any(c in table.columns for c in COLUMNS):  # BurstGPT: its failures left out
        table = table.rename(columns=dict(zip(BURSTGPT_COLUMNS, COLUMNS, strict=True)))
        table = table[pd.to_numeric(table["GeneratedTokens"], errors="coerce") != 0]
        named = dict(zip(COLUMNS, BURSTGPT_COLUMNS, strict=True))
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"workload trace {path}: missing column(s) {missing}; expected "
                         f"{list(COLUMNS)} (the Azure LLM inference trace format) or "
                         f"{list(BURSTGPT_COLUMNS)} (BurstGPT's)")
    if table.empty:
        raise ValueError(f"workload trace {path}: no requests")
    row = table.index.to_numpy()  # [n] the data rows' numbers in the file (0: the first)
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
        raise ValueError(f"workload trace {path}: {named['TIMESTAMP']} row "
                         f"{int(row[np.argmin(np.isfinite(t))])} is not a finite time")
    back = np.nonzero(np.diff(t) < 0)[0]
    if back.size:
        raise ValueError(f"workload trace {path}: {named['TIMESTAMP']} goes back in time at row "
                         f"{int(row[back[0] + 1])}; sort the file by time")
    counts = {}
    for col in COLUMNS[1:]:
        v = pd.to_numeric(table[col], errors="coerce").to_numpy(dtype=float)
        bad = np.nonzero(~np.isfinite(v) | (v < 1) | (v != np.round(v)))[0]
        if bad.size:
            raise ValueError(f"workload trace {path}: {named[col]} row {int(row[bad[0]])} is "
                             f"{str(table[col].iloc[int(bad[0])])!r}, not an integer >= 1")
        counts[col] = v.astype(np.int64)
    return RequestTrace(t - t[0], counts["ContextTokens"], counts["GeneratedTokens"],
                        str(path))


