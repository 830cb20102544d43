"""The decode step beside the receiver's on-arrival worker, as a ratio to the step alone.

With `transport.dequantize=on_arrival` (the receiver's default) one worker thread per
request dequantizes each layer of its cache as the layer's last chunk lands. In `kvsim
serve` that worker runs in the process that steps the decode batch, so while a request is
received every member of the batch steps beside it: they share the interpreter lock, the
cores and the memory bus. In the multi-request validation of 2026-12-07 the batch's steps
overlapped by a reception were 9-42% longer than the quiet steps of as many members, and the
extra grew with the worker's time inside the step (about 0.4 s per s of dequantization). On
a serving node the same work runs on the decode device, beside its steps. The simulator
charges it where asked to (`workload.worker_slows_decode`, kvsim.sim.batch) with this
measurement.

measure_beside_worker times each decode batch size B on B copies of a real cache, in blocks
of `steps` steps alone and `steps` steps while a thread of this process runs the worker's
job back to back: Codec.decode_layer of each layer of a real encoded cache in turn, fp32
out, with the finite check the worker makes (kvsim.calibrate.paired_steps: ROUNDS rounds per
size in alternating order; a size's ratio is the median over its rounds). The ratio falls as
the batch grows, and what it adds to a step does not: on 2026-12-08 at 512 tokens, x 2.00,
1.46, 1.41, 1.37, 1.43, 1.13, 1.26 and 1.27 for 1 to 8 members, 28 to 98 ms each (median 76)
on steps of 98 to 236 ms (as if the decoder waited for the interpreter lock at each of its
operations, a count that does not grow with the batch: not measured). So the simulator gets
that extra, in s: the median over the sizes of (ratio - 1) x the size's step alone
(`extra_s`), and a step of step_s beside a busy worker costs step_s + extra_s (`ratio`: 1 +
extra_s / the step alone, at each size measured), with the residual of those ratios against
the measured ones.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvsim.calibrate.paired_steps import paired_ratios
from kvsim.core.layout import all_finite

_SWITCH_TIMEOUT_S = 60.0  # a layer job in progress ends well within this
_POLL_S = 0.001


class WorkerNeighbour:
    """A thread that runs the on-arrival worker's layer jobs of one encoded cache back to
    back while `running` (a context manager: started on entry, stopped on exit)."""

    def __init__(self, codec: Any, kv: torch.Tensor) -> None:
        """codec: a layer-independent Codec; kv: [layers, 2, kv_heads, tokens, head_dim]."""
        if not codec.layer_independent:
            raise ValueError(f"{codec.name}: its layers do not decode alone, so the receiver "
                             "has no layer jobs for it (it dequantizes on demand); pick "
                             "another codec")
        enc = codec.encode(kv)
        self._codec, self._shape = codec, enc.shape
        # [layers][streams]: the chunks of each (layer, stream), as the worker is given them
        self._chunks = [[[c for c in enc.streams[s] if c.layer == layer]
                         for s in range(codec.num_streams)] for layer in range(enc.shape.layers)]
        self._go, self._stop = threading.Event(), threading.Event()
        self._busy = False  # a job runs now (from the first job after `go` to the last)
        self.jobs = 0  # layer jobs finished
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvsim-worker-neighbour",
                                        daemon=True)

    def job(self, i: int) -> None:
        """The worker's job for layer i % layers: every stream's chunks into fp32."""
        layer = i % self._shape.layers
        out = self._codec.decode_layer(self._shape, layer, self._chunks[layer],
                                       dtype=torch.float32)
        if not all_finite(out):
            raise RuntimeError(f"{self._codec.name}: layer {layer} decoded to non-finite "
                               "values")

    def _loop(self) -> None:
        try:
            i = 0
            while not self._stop.is_set():
                if not self._go.wait(timeout=0.05):
                    continue
                self._busy = True
                while self._go.is_set() and not self._stop.is_set():
                    self.job(i)
                    i += 1
                    self.jobs += 1
                self._busy = False
        except BaseException as exc:  # noqa: BLE001 (the measuring thread re-raises it)
            self.error = exc
            self._busy = False

    def __enter__(self) -> WorkerNeighbour:
        self.job(0)  # its first job (allocator, kernels) before anything is timed
        self._thread.start()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._stop.set()
        self._go.set()  # (wakes its wait)
        self._thread.join(timeout=_SWITCH_TIMEOUT_S)
        if exc_type is not None:  # what went wrong first is what is raised
            return
        if self._thread.is_alive():  # it would run on beside what is measured next
            raise TimeoutError(f"the worker neighbour's job did not end within "
                               f"{_SWITCH_TIMEOUT_S:.0f} s of its stop")
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise what stopped the thread, if anything did."""
        if self.error is not None:
            raise RuntimeError(f"the worker neighbour failed: {self.error!r}") from self.error

    def running(self, on: bool, timeout_s: float = _SWITCH_TIMEOUT_S) -> None:
        """Start the jobs (returns once one runs) or stop them (returns once the job in
        progress has ended)."""
        if on:
            self._go.set()
        else:
            self._go.clear()
        deadline = time.monotonic() + timeout_s
        while self._busy != on:
            self.raise_failure()
            if not self._thread.is_alive():
                raise RuntimeError("the worker neighbour's thread is not running")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker neighbour did not {'start' if on else 'stop'} "
                                   f"its jobs within {timeout_s:.0f} s")
            time.sleep(_POLL_S)
        self.raise_failure()  # failed in a job after the switch was seen


@torch.no_grad()
def measure_beside_worker(lm: Any, codec: Any, kv: torch.Tensor, batches: list[int],
                          steps: int, progress: Callable[[str], None] = lambda msg: None,
                          split_cpus: bool = False, label: str = "") -> dict:
    """The hardware profile's `tpot_beside_worker` entry: decode steps on B copies of kv
    [layers, 2, kv_heads, tokens, head_dim] (lm, this thread) beside a thread running the
    on-arrival worker's jobs of `codec` on kv's encoding. split_cpus: both on the decode
    host's half of this process's CPUs, as transport.split_cpus runs the receiver. label:
    the codec's name in the entry (its preset's label; "": codec.name)."""
    from kvsim.calibrate.model_profile import batch_stepper
    from kvsim.transport.cpus import format_cpus, halves, pinned

    decode_cpus = format_cpus(halves()[1]) if split_cpus else ""
    progress(f"decode steps beside the on-arrival worker dequantizing {codec.name} layers "
             f"of {kv.shape[3]} tokens")
    alone_s: list[float] = []
    with pinned(decode_cpus), WorkerNeighbour(codec, kv) as neighbour:
        ratios = paired_ratios(lambda b: batch_stepper(lm, kv, b), list(batches), steps,
                               neighbour.running, alone_s=alone_s)
    fitted = step_extra(ratios, alone_s)
    progress(f"beside the worker, batch {list(batches)} at {kv.shape[3]} tokens: x " +
             ", ".join(f"{r:.3f}" for r in ratios) + f" (the simulator's: +"
             f"{fitted['extra_s'] * 1e3:.1f} ms a step, x " +
             ", ".join(f"{r:.3f}" for r in fitted["ratio"]) +
             f"; residual rms {fitted['fit']['residual_rms_pct']:.1f}%)")
    return {"context_tokens": int(kv.shape[3]), "codec": label or str(codec.name),
            "batch": [int(b) for b in batches], "measured": ratios,
            "alone_s": alone_s, **fitted, "split_cpus": bool(split_cpus)}


def step_extra(ratios: list[float], alone_s: list[float]) -> dict:
    """What a busy worker adds to a step (s, at least 0): the median over the sizes of
    (ratio - 1) x step alone; the ratios it gives at those steps (`ratio`, 1 + extra_s / step
    alone) and their residual against `ratios` (%)."""
    if len(ratios) != len(alone_s) or not ratios or min(alone_s) <= 0:
        raise ValueError(f"need one positive step alone per ratio, got {ratios} and {alone_s}")
    extras = [(r - 1.0) * s for r, s in zip(ratios, alone_s, strict=True)]
    extra_s = max(0.0, float(statistics.median(extras)))
    model = [1.0 + extra_s / s for s in alone_s]
    off = [100.0 * (m / r - 1.0) for m, r in zip(model, ratios, strict=True)]
    return {"extra_s": extra_s, "ratio": model,
            "fit": {"per_size_extra_s": extras,
                    "residual_rms_pct": float(np.sqrt(np.mean(np.square(off)))),
                    "residual_max_pct": float(np.max(np.abs(off)))}}
