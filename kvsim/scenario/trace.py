"""Chrome-trace (chrome://tracing, Perfetto) event log: one complete event per phase."""

from __future__ import annotations

import json
from pathlib import Path


class TraceLog:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def span(self, name: str, process: str, thread: str, t0_s: float, t1_s: float,
             **args: object) -> None:
        if t1_s < t0_s:
            raise ValueError(f"trace span {name}: ends ({t1_s}) before it starts ({t0_s})")
        self.events.append({"name": name, "ph": "X", "pid": process, "tid": thread,
                            "ts": t0_s * 1e6, "dur": (t1_s - t0_s) * 1e6, "args": args})

    def write(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        return p
