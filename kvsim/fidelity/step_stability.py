"""How steady the host's decode step is: what the host alone adds to a per-request comparison.

A validation compares each scenario's few emulated requests (two repeats by default) with
the simulator's prediction at one step level, so a host whose decode step moves from one
request to the next puts that movement into every row's error. This module measures it with
nothing else of kvsim running: `runs` runs of `steps` greedy decode steps each, every run on a
fresh cache built from the same KV (as the receiver builds one per request), in a thread as
the receiver's decode loop runs (kvsim.fidelity.decode_steps.timed_steps), the host's
other work measured over each run (kvsim.core.host_load). What it reports:

    ratio           a run's mean step over the median run's
    consecutive     |a run's mean step / the run before's - 1|: what two back-to-back
                    repeats of one request would differ by in their steps alone
    cv              the runs' standard deviation over their mean
    two_runs_off    |the mean of two back-to-back runs / the median run - 1|: how far the
                    average of two requests' steps lies from the host's typical step, with
                    nothing but the host moving it (a validation's rows average two
                    repeats, though not back to back: its repeats of one codec are
                    interleaved with the other codecs')
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepRun:
    """One run: `steps` decode steps on a fresh cache at context_tokens."""

    context_tokens: int
    run: int
    mean_step_s: float
    median_step_s: float
    background_cores: float | None  # other work's CPUs over the run (None: not readable)
    steal_cores: float | None


@dataclass(frozen=True)
class Stability:
    """The runs' spread at one context (ratios; 0.05 is 5%)."""

    context_tokens: int
    runs: int
    median_step_s: float
    cv: float
    consecutive_mean: float  # mean |run / run before - 1|
    consecutive_max: float
    two_runs_off_mean: float  # mean over back-to-back pairs of |their mean / median run - 1|
    two_runs_off_max: float
    slowest_over_fastest: float


def stability(runs: list[StepRun]) -> Stability:
    """The spread of `runs` (>= 2, one context) of their mean steps."""
    if len(runs) < 2 or len({r.context_tokens for r in runs}) != 1:
        raise ValueError("stability needs >= 2 runs at one context")
    means = [r.mean_step_s for r in runs]
    back_to_back = list(zip(means[:-1], means[1:], strict=True))
    changes = [abs(b / a - 1.0) for a, b in back_to_back]
    median = statistics.median(means)
    two_runs_off = [abs((a + b) / 2.0 / median - 1.0) for a, b in back_to_back]
    mean = statistics.fmean(means)
    return Stability(runs[0].context_tokens, len(runs), median,
                     statistics.pstdev(means) / mean, statistics.fmean(changes), max(changes),
                     statistics.fmean(two_runs_off), max(two_runs_off), max(means) / min(means))


def measure(lm: Any, kv: torch.Tensor, token: int, runs: int, steps: int, threads: int,
            timeout_s: float, say: Callable[[str], None] = lambda msg: None) -> list[StepRun]:
    """`runs` StepRuns of `steps` decode steps (after the first) on fresh caches built from
    kv [layers, 2, kv_heads, tokens, head_dim], greedy from `token`; timeout_s per run."""
    from kvsim.core.host_load import HostLoadMeter
    from kvsim.fidelity.decode_steps import timed_steps

    if runs < 2 or steps < 1:
        raise ValueError(f"need runs >= 2 and steps >= 1, got {runs}, {steps}")
    context = int(kv.shape[3])
    out = []
    for i in range(runs):
        meter = HostLoadMeter()
        times = timed_steps(lm, kv, token, steps, threads, timeout_s)
        load = meter.read()
        out.append(StepRun(context, i, statistics.fmean(times), statistics.median(times),
                           load.background_cores if load else None,
                           load.steal_cores if load else None))
        say(f"context {context}: run {i + 1}/{runs}: {out[-1].mean_step_s * 1e3:.1f} ms per "
            "step" + (f" ({load.background_cores:.2f} CPUs of other work)" if load else ""))
    return out
