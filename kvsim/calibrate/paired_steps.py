"""Decode steps timed alone and beside a neighbour's work, in pairs, as a ratio per batch size.

A neighbour (a prefill in another process: kvsim.calibrate.beside_prefill; the on-arrival
worker's dequantization in a thread of this one: kvsim.calibrate.beside_worker) slows a
decode step by a few percent to a few tens, about what the host's own speed drifts over a
minute. So each batch size is timed in rounds of a block of steps alone and a block beside
the neighbour, the two in the same minute, and a size's ratio is the median over its
rounds of (median step beside) / (median step alone). Beside a prefill the simulator gets
the least-squares line through the sizes' ratios over the batch size, with its residual
(slowdown_line: one size's rounds scatter by about the effect itself); beside the worker,
what it adds to a step (kvsim.calibrate.beside_worker).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvsim.calibrate.step_fit import fit_step_line

ROUNDS = 3  # blocks alone and beside per batch size


def paired_ratios(step_for: Callable[[int], Callable[[], Any]], batches: list[int],
                  steps: int, beside: Callable[[bool], None], rounds: int = ROUNDS,
                  clock: Callable[[], float] = time.perf_counter,
                  alone_s: list[float] | None = None) -> list[float]:
    """[len(batches)] each size's step beside over alone (see the module docstring); given
    `alone_s`, each size's step alone (s, the median over its rounds) is appended to it.
    step_for(B) -> one decode step of batch B (made once per size); beside(on) switches the
    neighbour's work on (returning once it runs) or off (once it has stopped). Rounds
    alternate their order (alone then beside, beside then alone: the block after a switch
    is not always the same kind), and each block's first step after a switch is not timed
    (its caches were the other kind's)."""
    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be >= 1, got {steps}, {rounds}")

    def block(step: Callable[[], Any]) -> float:
        step()  # after a switch: not timed
        times = []
        for _ in range(steps):
            t0 = clock()
            step()
            times.append(clock() - t0)
        return float(statistics.median(times))

    def timed_beside(step: Callable[[], Any]) -> float:
        beside(True)
        try:
            out = block(step)
        except BaseException:
            with contextlib.suppress(Exception):  # what went wrong first is what is raised
                beside(False)
            raise
        beside(False)
        return out

    ratios = []
    for b in batches:
        step = step_for(b)  # (its first, slower step is the first block's untimed one)
        per_round, alone = [], []
        for r in range(rounds):
            if r % 2 == 0:
                alone.append(block(step))
                per_round.append(timed_beside(step) / alone[-1])
            else:
                beside_s = timed_beside(step)
                alone.append(block(step))
                per_round.append(beside_s / alone[-1])
        ratios.append(float(statistics.median(per_round)))
        if alone_s is not None:
            alone_s.append(float(statistics.median(alone)))
        del step  # its batched cache goes before the next size's is made
    return ratios


def slowdown_line(batches: list[int], ratios: list[float]) -> dict:
    """The simulator's ratios from each size's median: the least-squares line over the batch
    size, non-decreasing (kvsim.calibrate.step_fit), then at least 1 at every size (a
    prefill beside the steps does not make them faster: a line below 1 is the rounds'
    scatter). Returns the fitted ratios (`ratio`) and the fit."""
    line = fit_step_line(batches, ratios)
    return {"ratio": [max(1.0, r) for r in line["s"]],
            "fit": {"fixed": line["fixed_s"], "per_member": line["s_per_token"],
                    "residual_rms_pct": line["residual_rms_pct"],
                    "residual_max_pct": line["residual_max_pct"]}}
