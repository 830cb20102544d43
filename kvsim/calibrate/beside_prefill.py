"""The decode step beside a live prefill on the same host, as a ratio to the step alone.

`kvsim emulate` runs the prefill side (the sender: real prefills) and the decode side (`kvsim
serve`: real decode steps) as two processes of one machine. A disaggregated deployment gives
each its own, but on the emulating host a prefill running in the sender slows the decode
host's steps (each process has a core of its own at transport.threads=1 on this 2-core
host, and they share the memory bus and the last-level cache): on 2026-12-07 a standalone
step at 512 tokens was 5% slower beside a 512-token prefill in another process, a batch of 2
5-10%, of 3 10% and of 4 15%, and the emulator's own steps beside its prefills x 0.93-1.07
over three validation runs. The simulator charges it where asked to mirror such a host
(`workload.colocated_prefill`, kvsim.sim.batch), with these ratios.

measure_beside_prefill times each decode batch size B on B copies of a real cache in this
process, in blocks of `steps` steps alone and `steps` steps while a child process prefills
a real prompt back to back (the same model, threads and prefill code as the sender's),
ROUNDS rounds of each per size (paired_ratios: in alternating order, the first step after
a switch not timed). A size's ratio is the median over rounds of (median step
beside) / (median step alone) of the round: a block alone and the block beside it fall in
the same minute, so the host's speed drifting between sizes moves both alike. The effect is
a few percent, about the spread of one size's rounds (one calibration of 2026-12-07 gave x
1.145, 1.029, 0.963, 1.048, 1.010, 1.124, 1.044 and 1.014 for 1 to 8 members from two
rounds each), so the profile keeps those medians (`measured`) and gives the simulator the
least-squares line through them over the batch size (`ratio`: slowdown_line), with its
residual.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import torch

from kvsim.calibrate.paired_steps import paired_ratios, slowdown_line

_READY_TIMEOUT_S = 300.0  # the child's model load and first prefill
_POLL_S = 0.01


def _prefill_loop(model: Any, threads: int, ids: list[int], cpus: str, go: Any, stop: Any,
                  busy: Any, failed: Any) -> None:
    """The child: load the model (on the CPU list `cpus`, "": anywhere), then prefill `ids`
    back to back while `go` is set (busy = 1 from the start of one prefill to the end of
    the last), until `stop` or its parent is gone (a parent killed outright never sets
    stop: the child must not prefill on, unseen, beside every later measurement)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
    parent = mp.parent_process()

    def wanted() -> bool:
        return not stop.is_set() and (parent is None or parent.is_alive())
    try:
        from kvsim.kv.capture import prefill
        from kvsim.model.load import load_lm
        from kvsim.transport.cpus import pin_listed

        pin_listed(cpus)
        lm = load_lm(model, threads=threads, seed=0)
        torch.set_num_threads(threads)
        with torch.no_grad():
            prefill(lm.model, ids[:64])  # warm: allocator and kernels
            busy.value = 0  # ready
            while wanted():
                if not go.wait(timeout=0.05):
                    continue
                busy.value = 1
                while go.is_set() and wanted():
                    prefill(lm.model, ids)
                busy.value = 0
    except BaseException:  # the parent reads it; its waits would time out otherwise
        failed.value = 1
        raise


class PrefillNeighbour:
    """A child process that prefills a real prompt back to back while `running` (a context
    manager: started on entry, stopped on exit; cpus: a CPU list it runs on, "" anywhere)."""

    def __init__(self, model: Any, threads: int, ids: list[int],
                 timeout_s: float = _READY_TIMEOUT_S, cpus: str = "") -> None:
        ctx = mp.get_context("spawn")  # a clean interpreter: no torch state forked
        self._go, self._stop = ctx.Event(), ctx.Event()
        self._busy, self._failed = ctx.Value("i", -1), ctx.Value("i", 0)
        self._proc = ctx.Process(target=_prefill_loop, daemon=True, name="prefill-neighbour",
                                 args=(model, threads, list(ids), cpus, self._go,
                                       self._stop, self._busy, self._failed))
        self.timeout_s = float(timeout_s)

    def __enter__(self) -> PrefillNeighbour:
        self._proc.start()
        try:
            self._wait(lambda: self._busy.value == 0, self.timeout_s, "load its model")
        except BaseException:
            self.__exit__()  # (not called by `with` when entering fails)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._go.set()  # (wakes its wait)
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self._failed.value or not self._proc.is_alive():
                self._proc.join(timeout=5)  # (its exit code, once it has one)
                raise RuntimeError(f"the prefill neighbour process failed to {what} (exit code "
                                   f"{self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the prefill neighbour did not {what} within "
                                   f"{timeout_s:.0f} s")
            time.sleep(_POLL_S)

    def running(self, on: bool, timeout_s: float) -> None:
        """Start prefilling (returns once a prefill runs) or stop (returns once the
        prefill in progress has ended)."""
        if on:
            self._go.set()
            self._wait(lambda: self._busy.value == 1, timeout_s, "start prefilling")
        else:
            self._go.clear()
            self._wait(lambda: self._busy.value == 0, timeout_s, "end its prefill")


@torch.no_grad()
def measure_beside_prefill(lm: Any, model: Any, threads: int, kv: torch.Tensor,
                           prompt_ids: list[int], batches: list[int], steps: int,
                           progress: Callable[[str], None] = lambda msg: None,
                           split_cpus: bool = False) -> dict:
    """The hardware profile's `tpot_beside_prefill` entry: decode steps on B copies of kv
    [layers, 2, kv_heads, tokens, head_dim] (lm, this process) beside a child prefilling
    prompt_ids (`model`, loaded there with `threads` torch threads). split_cpus: the child
    on the sender's half of this process's CPUs and the steps on the decode host's, as
    transport.split_cpus runs them (kvsim.transport.cpus)."""
    from kvsim.calibrate.model_profile import batch_stepper
    from kvsim.transport.cpus import format_cpus, halves, pinned

    sender_cpus, decode_cpus = (format_cpus(c) for c in halves()) if split_cpus else ("", "")
    progress(f"decode steps beside a {len(prompt_ids)}-token prefill in another process: "
             "starting it")
    with pinned(decode_cpus), \
            PrefillNeighbour(model, threads, prompt_ids, cpus=sender_cpus) as neighbour:
        # stopping waits for the prefill in progress: a few times one, at most
        ratios = paired_ratios(lambda b: batch_stepper(lm, kv, b), list(batches), steps,
                               lambda on: neighbour.running(on, _READY_TIMEOUT_S))
    fitted = slowdown_line(list(batches), ratios)
    progress(f"beside a prefill, batch {list(batches)} at {kv.shape[3]} tokens: x " +
             ", ".join(f"{r:.3f}" for r in ratios) + " (the simulator's line: x " +
             ", ".join(f"{r:.3f}" for r in fitted["ratio"]) +
             f"; residual rms {fitted['fit']['residual_rms_pct']:.1f}%)")
    return {"context_tokens": int(kv.shape[3]), "prefill_tokens": len(prompt_ids),
            "batch": [int(b) for b in batches], "ratio": fitted["ratio"], "measured": ratios,
            "fit": fitted["fit"], "split_cpus": bool(split_cpus)}
