"""The real model's decode steps timed as the receiver's decode loop runs them: greedy, on
a fresh cache built from the KV as the receiver builds one, in a thread of its own with the
decoder's torch threads. Used where a step is measured against something (kvsim bench draft:
beside a load; kvsim bench step: run after run)."""

from __future__ import annotations

import threading
from typing import Any

import torch


def timed_steps(lm: Any, kv: torch.Tensor, token: int, steps: int, threads: int,
                timeout_s: float) -> list[float]:
    """[steps] s: greedy decode steps (after the first) on a fresh cache built from kv
    [layers, 2, kv_heads, tokens, head_dim], in a new thread with `threads` torch threads,
    as the receiver's decode loop runs. On a timeout that thread is left running (a daemon:
    it cannot be stopped from outside)."""
    from kvsim.calibrate.model_profile import _dtype, _steps_s
    from kvsim.kv.capture import kv_to_cache

    out: dict[str, Any] = {}

    def go() -> None:
        try:
            torch.set_num_threads(threads)
            cache = kv_to_cache(kv.float(), lm.model.config, _dtype(lm))
            out["steps"] = _steps_s(lm, cache, token, steps)[1]
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller)
            out["error"] = exc

    t = threading.Thread(target=go, name="kvsim-timed-steps", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"building the cache and {steps + 1} decode steps took more than "
                           f"{timeout_s} s")
    if "error" in out:
        raise out["error"]
    return [float(x) for x in out["steps"]]
