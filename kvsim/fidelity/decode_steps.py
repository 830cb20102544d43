"""The real model's decode steps timed as the receiver's decode loop runs them: greedy, on
a fresh cache built from the KV as the receiver builds one, in a thread of its own with the
decoder's torch threads; and the prompt's KV they decode on. Used where a step is measured
against something (kvsim bench draft: beside a load; kvsim bench step: run after run)."""

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


def check_contexts(contexts: list[int]) -> None:
    """A bench's contexts: a non-empty list of prompts of >= 16 tokens (ValueError)."""
    if not contexts or any(int(c) < 16 for c in contexts):
        raise ValueError(f"contexts must be a non-empty list of >= 16 tokens, got {contexts}")


def prompt_kv(lm: Any, context_tokens: int, text_source: str, seed: int
              ) -> tuple[torch.Tensor, int]:
    """(kv [layers, 2, kv_heads, context_tokens, head_dim] bf16, the first generated token) of
    the calibration's prompt of that length (kvsim.calibrate.model_profile), prefilled."""
    from kvsim.calibrate.model_profile import ModelCalibration, _prompt
    from kvsim.kv.capture import cache_to_kv, prefill

    ids = _prompt(lm, int(context_tokens),
                  ModelCalibration([int(context_tokens)], text_source=text_source, seed=seed))
    with torch.no_grad():
        cache, logits = prefill(lm.model, ids)
    return cache_to_kv(cache).to(torch.bfloat16), int(torch.argmax(logits))
