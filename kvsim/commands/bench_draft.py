"""Decode-step contention: the real model's decode step alone and beside a background thread
running the on-arrival worker's layer jobs, lock-free compute, lock-free memory copies or
pure Python (kvsim.fidelity.draft_contention); each as a ratio to the plain step of the
same round. What the simulator's draft-step slowdown (`draft_step.busy_ratio`) is made of
on this host."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from kvsim.core.report import format_table
from kvsim.model.spec import ModelSpec

COMMAND = ("bench", "draft")
HELP = "decode step beside the dequantization worker, compute, memory and Python loads"
CONFIG_NAME = "bench_draft"


@dataclass
class Config:
    model: ModelSpec = MISSING
    contexts: list[int] = field(default_factory=lambda: [1024, 2048])  # prompt tokens
    # the layer jobs' codec: a preset name or mapping whose layers decode alone (not `codec`:
    # that name is the codec config group's)
    job_codec: Any = "lynx"
    # also "python": with Python's 5 ms switch interval it starves the decoder (steps of
    # seconds), so it is not run unless asked for
    loads: list[str] = field(default_factory=lambda: ["layer_jobs", "layer_jobs_1thread",
                                                      "compute", "memory"])
    steps: int = 10  # decode steps timed per measurement (median, after the first)
    rounds: int = 2  # plain step + every load, this many times (ratios within a round)
    threads: int = 1  # the decoder's torch threads (transport.threads)
    switch_interval_s: float | None = None  # the interpreter's (null: Python's 5 ms)
    text_source: str = "stdlib-docs"
    seed: int = 1009  # the prompts' text seed (calibration's)
    timeout_s: float = 600.0  # per measurement
    progress: bool = True

    def __post_init__(self) -> None:
        from kvsim.fidelity.draft_contention import check_loads

        check_loads(list(self.loads))
        if self.switch_interval_s is not None and not self.switch_interval_s > 0:
            raise ValueError(f"switch_interval_s must be null or > 0, got "
                             f"{self.switch_interval_s}")
        from kvsim.fidelity.decode_steps import check_contexts

        check_contexts(list(self.contexts))
        if self.steps < 2 or self.rounds < 1 or self.threads < 1:
            raise ValueError(f"need steps >= 2, rounds >= 1, threads >= 1; got {self.steps}, "
                             f"{self.rounds}, {self.threads}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def run(cfg: Config) -> list[dict]:
    from kvsim.fidelity.decode_steps import prompt_kv
    from kvsim.fidelity.draft_contention import check_loads, measure, switch_interval
    from kvsim.kernels.presets import resolve_codec
    from kvsim.model.load import load_lm

    say = (lambda msg: print(f"bench draft: {msg}", file=sys.stderr, flush=True)) \
        if cfg.progress else (lambda msg: None)
    spec = resolve_codec(cfg.job_codec)
    codec = spec.build()
    check_loads(list(cfg.loads), codec)  # before the model loads (measure checks again)
    lm = load_lm(cfg.model, threads=cfg.threads, seed=0)  # sets torch's threads
    undo = switch_interval(cfg.switch_interval_s)
    results = []
    try:
        for ctx in cfg.contexts:
            kv, token = prompt_kv(lm, int(ctx), cfg.text_source, cfg.seed)
            results += measure(lm, codec, kv, token, list(cfg.loads), cfg.steps, cfg.rounds,
                               cfg.threads, cfg.timeout_s, say)
    finally:
        undo()
    rows = [{**r.row(), "codec": spec.label, "model": lm.name,
             "switch_interval_s": cfg.switch_interval_s} for r in results]
    summary = []
    for ctx in cfg.contexts:
        for load in ["none", *cfg.loads]:
            mine = [r for r in results if r.context_tokens == ctx and r.load == load]
            summary.append({"context_tokens": ctx, "load": load,
                            "step_ms": 1e3 * statistics.median(r.step_s for r in mine),
                            "ratio": statistics.median(r.ratio for r in mine),
                            "ratio_range": f"{min(r.ratio for r in mine):.2f}-"
                                           f"{max(r.ratio for r in mine):.2f}",
                            "load_op_ms": 1e3 * statistics.median(r.load_op_s for r in mine)})
    print(format_table(summary, [("context_tokens", "ctx", "d"), ("load", "beside", ""),
                                 ("step_ms", "step ms", ".1f"),
                                 ("ratio", "vs plain (median)", ".2f"),
                                 ("ratio_range", "rounds", ""),
                                 ("load_op_ms", "load op ms", ".2f")]))
    print(f"{spec.label} layer jobs; decoder: {cfg.threads} torch thread(s) in a thread of its "
          f"own; ratios to the plain step of the same round ({cfg.rounds} round(s))")
    return rows
