"""The host's decode step, run after run: how much it moves between back-to-back requests
with nothing else of kvsim running (kvsim.fidelity.step_stability). What the host alone puts
into `kvsim validate`'s per-request comparisons."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from omegaconf import MISSING

from kvsim.core.report import format_table
from kvsim.model.spec import ModelSpec

if TYPE_CHECKING:
    from kvsim.fidelity.step_stability import Stability

COMMAND = ("bench", "step")
HELP = "the decode step's spread from run to run on this host (its part in a validation's errors)"
CONFIG_NAME = "bench_step"


@dataclass
class Config:
    model: ModelSpec = MISSING
    contexts: list[int] = field(default_factory=lambda: [1024])  # prompt tokens
    runs: int = 12  # runs per context, each on a fresh cache (as one request each)
    steps: int = 32  # decode steps timed per run (after the first)
    threads: int = 1  # the decoder's torch threads (transport.threads)
    text_source: str = "stdlib-docs"
    seed: int = 1009  # the prompts' text seed (calibration's)
    timeout_s: float = 600.0  # per run (its cache build and every step)
    progress: bool = True

    def __post_init__(self) -> None:
        from kvsim.fidelity.decode_steps import check_contexts

        check_contexts(list(self.contexts))
        if self.runs < 2 or self.steps < 1 or self.threads < 1:
            raise ValueError(f"need runs >= 2, steps >= 1, threads >= 1; got {self.runs}, "
                             f"{self.steps}, {self.threads}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def run(cfg: Config) -> dict:
    from kvsim.fidelity.decode_steps import prompt_kv
    from kvsim.fidelity.step_stability import measure, stability
    from kvsim.model.load import load_lm

    say = (lambda msg: print(f"bench step: {msg}", file=sys.stderr, flush=True)) \
        if cfg.progress else (lambda msg: None)
    lm = load_lm(cfg.model, threads=cfg.threads, seed=0)  # sets torch's threads
    rows, summary = [], []
    for ctx in cfg.contexts:
        kv, token = prompt_kv(lm, int(ctx), cfg.text_source, cfg.seed)
        runs = measure(lm, kv, token, cfg.runs, cfg.steps, cfg.threads, cfg.timeout_s, say)
        spread = stability(runs)
        mine = [{**asdict(r), "ratio": r.mean_step_s / spread.median_step_s, "model": lm.name}
                for r in runs]
        rows += mine
        summary.append(asdict(spread))
        # printed as each context ends: a later context's failure keeps this one's figures
        _print(mine, spread, cfg.steps)
    return {"rows": rows, "stability": summary}


def _print(rows: list[dict], spread: Stability, steps: int) -> None:
    """One context's runs (each run's mean step and its ratio to the median run's) and their
    spread."""
    print(format_table(rows, [("context_tokens", "ctx", "d"), ("run", "run", "d"),
                              ("mean_step_s", "mean step s", ".4f"),
                              ("ratio", "x median run", ".3f"),
                              ("background_cores", "other CPUs", ".2f")]))
    print(f"context {spread.context_tokens}: {spread.runs} runs of {steps} steps each, the "
          f"median run's mean step {spread.median_step_s * 1e3:.1f} ms\n"
          f"  back-to-back runs differ by {spread.consecutive_mean * 100:.1f}% on average, "
          f"{spread.consecutive_max * 100:.1f}% at most\n"
          f"  the average of two back-to-back runs is off the median run by "
          f"{spread.two_runs_off_mean * 100:.1f}% on average, "
          f"{spread.two_runs_off_max * 100:.1f}% at most\n"
          f"  coefficient of variation {spread.cv * 100:.1f}%, slowest / fastest run "
          f"{spread.slowest_over_fastest:.3f}", flush=True)
