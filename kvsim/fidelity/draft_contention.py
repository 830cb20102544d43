"""What slows a decode step while other work runs in the receiver's process.

The simulator's draft step on a partial cache is the plain decode step times a slowdown
calibrated while the on-arrival worker dequantizes (hardware `draft_step.busy_ratio`). On a
CPU host that slowdown is the emulator's own physics, and it has more than one source: the
decoder and the worker share the interpreter lock (every torch op of the decoder releases
and takes it back), the memory bus, and the cores. This module measures each on its own:
the real model's decode step (greedy, `threads` torch threads, in a thread of its own, as
the receiver's decode loop) alone, then beside one background thread running, in a loop,

    layer_jobs  the codec's layer dequantization as the on-arrival worker runs it
                (Codec.decode_layer of each layer in turn, fp32 out; numba's parallel
                kernels on every core, as in the receiver)
    layer_jobs_1thread  the same with numba limited to 1 thread in that thread (the
                decoder's core left to it)
    compute     arithmetic on a 16 KB array in numba without the lock (cores only)
    memory      a numba copy of a 64 MB array without the lock (the memory bus)
    python      a pure-Python loop (the lock held but at the interpreter's switch points)

Each load's step is reported as a ratio to the plain step of the same round, so that the
host's drift between rounds cancels.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch

LOADS = ("layer_jobs", "layer_jobs_1thread", "compute", "memory", "python")
LAYER_JOB_LOADS = ("layer_jobs", "layer_jobs_1thread")  # the ones that need the codec's jobs
COMPUTE_VALUES = 4096  # fp32: 16 KB, stays in L1
MEMORY_VALUES = 16 << 20  # fp32: 64 MB, larger than any L3 here


@numba.njit(nogil=True, cache=False)
def _compute(x: np.ndarray, passes: int) -> float:
    acc = 0.0
    for _ in range(passes):
        for i in range(x.shape[0]):
            acc = acc * 0.999999 + x[i]
    return acc


@numba.njit(nogil=True, cache=False)
def _copy(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(src.shape[0]):
        dst[i] = src[i]


def _python(n: int) -> int:
    acc = 0
    for i in range(n):
        acc += i
    return acc


@dataclass
class Contention:
    """One load at one context: the decode step beside it and the plain step of its round."""

    context_tokens: int
    load: str  # "none" for the plain step itself, else one of LOADS
    round: int
    step_s: float  # median decode step
    plain_step_s: float  # median decode step alone, same round
    load_ops: int  # operations the load finished while it ran (from before the first timed
    # step, the cache built, to just after the last)
    load_op_s: float  # median duration of one (0 for "none")

    @property
    def ratio(self) -> float:
        return self.step_s / self.plain_step_s

    def row(self) -> dict:
        return {"context_tokens": self.context_tokens, "load": self.load, "round": self.round,
                "step_s": self.step_s, "plain_step_s": self.plain_step_s,
                "ratio": self.ratio, "load_ops": self.load_ops, "load_op_s": self.load_op_s}


def check_loads(loads: list[str], codec: Any = None) -> None:
    """Refuse unknown loads, none, and (given the codec) layer-job loads of a codec whose
    layers do not decode alone."""
    bad = [x for x in loads if x not in LOADS]
    if bad or not loads:
        raise ValueError(f"unknown load(s) {bad}: loads must be a non-empty list of "
                         f"{list(LOADS)}, got {list(loads)}")
    if codec is not None and set(LAYER_JOB_LOADS) & set(loads) and not codec.layer_independent:
        raise ValueError(f"{codec.name}: its layers do not decode alone, so the receiver has no "
                         "layer jobs for it (it dequantizes on demand); pick another codec")


def _load_op(load: str, codec: Any, shape: Any, layer_chunks: list) -> Callable[[int], Any]:
    """load -> one operation of it (argument: the operation's index)."""
    if load in LAYER_JOB_LOADS:
        return lambda i: codec.decode_layer(shape, i % shape.layers,
                                            layer_chunks[i % shape.layers],
                                            dtype=torch.float32)
    if load == "compute":
        x = np.ones(COMPUTE_VALUES, np.float32)
        return lambda i: _compute(x, 400)
    if load == "memory":
        src = np.ones(MEMORY_VALUES, np.float32)
        dst = np.empty_like(src)
        return lambda i: _copy(src, dst)
    if load == "python":
        return lambda i: _python(20_000)
    raise ValueError(f"unknown load {load!r}; choose from {LOADS}")


def _timed_steps(lm: Any, kv: torch.Tensor, token: int, steps: int, threads: int,
                 timeout_s: float) -> float:
    """Median of `steps` decode steps (after the first) on a fresh cache
    (kvsim.fidelity.decode_steps.timed_steps)."""
    from kvsim.fidelity.decode_steps import timed_steps

    return float(statistics.median(timed_steps(lm, kv, token, steps, threads, timeout_s)))


def measure(lm: Any, codec: Any, kv: torch.Tensor, token: int, loads: list[str],
            steps: int, rounds: int, threads: int = 1, timeout_s: float = 600.0,
            say: Callable[[str], None] = lambda msg: None) -> list[Contention]:
    """kv: the prompt's cache [layers, 2, kv_heads, tokens, head_dim] (its first generated
    token `token`). Per round: the plain step, then each load's."""
    check_loads(loads, codec)
    if steps < 2 or rounds < 1:
        raise ValueError(f"need steps >= 2 and rounds >= 1, got {steps}, {rounds}")
    enc = codec.encode(kv)
    layer_chunks = [[[c for c in enc.streams[s] if c.layer == layer]
                     for s in range(codec.num_streams)] for layer in range(enc.shape.layers)]
    ops = {name: _load_op(name, codec, enc.shape, layer_chunks) for name in loads}
    for op in ops.values():  # compile and fault in before anything is timed
        op(0)
    context = int(kv.shape[3])
    out: list[Contention] = []
    for r in range(rounds):
        plain = _timed_steps(lm, kv, token, steps, threads, timeout_s)
        out.append(Contention(context, "none", r, plain, plain, 0, 0.0))
        say(f"{context} tokens, round {r}: plain step {plain * 1e3:.1f} ms")
        for name, op in ops.items():
            stop = threading.Event()
            durations: list[float] = []
            failed: list[BaseException] = []

            def loop(op: Callable[[int], Any] = op, durations: list[float] = durations,
                     stop: threading.Event = stop, failed: list[BaseException] = failed,
                     one_thread: bool = name == "layer_jobs_1thread") -> None:
                try:
                    if one_thread:
                        numba.set_num_threads(1)  # this thread's launches only
                    i = 0
                    while not stop.is_set():
                        t0 = time.perf_counter()
                        op(i)
                        durations.append(time.perf_counter() - t0)
                        i += 1
                except BaseException as exc:  # noqa: BLE001 (re-raised below)
                    failed.append(exc)

            worker = threading.Thread(target=loop, name=f"kvsim-draft-contention-{name}",
                                      daemon=True)
            worker.start()
            try:
                step = _timed_steps(lm, kv, token, steps, threads, timeout_s)
            finally:
                stop.set()
                worker.join(timeout_s)
            if worker.is_alive():
                raise TimeoutError(f"the {name} load did not stop within {timeout_s} s")
            if failed:  # the steps ran without their load: no measurement
                raise RuntimeError(f"the {name} load failed: {failed[0]!r}") from failed[0]
            op_s = float(statistics.median(durations)) if durations else 0.0
            out.append(Contention(context, name, r, step, plain, len(durations), op_s))
            say(f"  beside {name}: step {step * 1e3:.1f} ms ({step / plain:.2f}x), "
                f"{len(durations)} ops of {op_s * 1e3:.2f} ms")
    return out


def switch_interval(seconds: float | None) -> Callable[[], None]:
    """Set the interpreter's thread switch interval (None: leave it); returns the undo."""
    before = sys.getswitchinterval()
    if seconds is not None:
        if not seconds > 0:
            raise ValueError(f"switch_interval_s must be > 0, got {seconds}")
        sys.setswitchinterval(seconds)
    return lambda: sys.setswitchinterval(before)
