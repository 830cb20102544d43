"""Simulator speed: (1) one 128K-token request on a 64-layer model with page-level chunks,
(2) 10,000 requests over 16 prefill + 16 decode instances. Reports wall seconds, simpy
events and events/s, and the ratio to a bare simpy timeout loop timed in the same run
(the simulator's cost per event relative to simpy's own)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import simpy

from kvsim.cli import compose
from kvsim.config.sim import SimConfig
from kvsim.report import format_table
from kvsim.sim.run import Scenario, variants

COMMAND = ("bench", "sim")
HELP = "simulator speed: 128K-token single request and 10,000-request cluster run"
CONFIG_NAME = "bench_sim"


@dataclass
class Config:
    # each case: a name and the `kvsim sim` overrides that define it
    cases: dict[str, list[str]] = field(default_factory=dict)
    targets_s: dict[str, float] = field(default_factory=dict)  # the wall-time goals
    repeats: int = 3  # best of
    baseline_events: int = 200000  # bare simpy timeouts timed for the ratio


def simpy_baseline_events_per_s(n: int) -> float:
    env = simpy.Environment()

    def ticker():
        for _ in range(n):
            yield env.timeout(1e-6)

    env.process(ticker())
    t0 = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t0)


def run(cfg: Config) -> list[dict]:
    base = simpy_baseline_events_per_s(cfg.baseline_events)
    rows = []
    for name, overrides in cfg.cases.items():
        sim_cfg, _ = compose("sim", list(overrides), SimConfig)
        variant = variants(sim_cfg)[0]  # the first codec x transfer of the case
        best = None
        for _ in range(max(1, cfg.repeats)):
            # free what the previous case left (a 100k-request run leaves ~1 GB of cycles)
            # so that its collection is not timed as part of this case
            gc.collect()
            t0 = time.perf_counter()
            row = Scenario(sim_cfg, variant, sim_cfg.workload.context_tokens,
                           sim_cfg.link.bandwidth_gbps).run()
            wall = time.perf_counter() - t0  # includes size tables and plans
            if best is None or wall < best[0]:
                best = (wall, row)
        wall, row = best
        target = cfg.targets_s.get(name)
        rows.append({
            "case": name, "model": row["model"], "codec": row["codec"],
            "transfer": row["transfer"], "requests": row["requests"],
            "context_tokens": row["context_tokens"], "granularity": sim_cfg.granularity,
            "wall_s": wall, "target_s": target,
            # per request: comparable across event models (events/s is not: fewer, heavier
            # events per request lower it while the run gets faster)
            "ms_per_request": 1e3 * wall / row["requests"],
            "meets_target": (wall <= target) if target else None,
            "events": row["events"], "events_per_s": row["events"] / wall,
            "messages": row["messages"], "messages_per_s": row["messages"] / wall,
            "simpy_baseline_events_per_s": base,
            "ratio_to_simpy": row["events"] / wall / base,
            "ttft_s": row["ttft_s"], "sim_end_s": row["sim_end_s"],
            "link_utilisation": row["link_utilisation"], "overrides": list(overrides),
        })
    print(format_table(rows, [("case", "case", ""), ("model", "model", ""),
                              ("codec", "codec", ""), ("requests", "req", "d"),
                              ("granularity", "chunks", ""), ("wall_s", "wall s", ".3f"),
                              ("ms_per_request", "ms/request", ".3f"),
                              ("target_s", "target s", "g"), ("events", "events", "d"),
                              ("events_per_s", "events/s", ".0f"),
                              ("messages", "messages", "d"),
                              ("messages_per_s", "messages/s", ".0f"),
                              ("ratio_to_simpy", "vs bare simpy", ".2f")]))
    print(f"bare simpy timeout loop: {base:.0f} events/s")
    return rows
