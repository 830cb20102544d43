"""Measure the real model and the codecs on this machine, as the transport runs them: the
hardware profile (prefill time vs context, decode step time vs context and batch, the extra
cost of the first step on a freshly built cache, verification time vs drafted tokens) and
the codec timing of the transport's two ends (encode layer by layer with the payload
checksum, as the sender; dequantize n streams and build the model's cache, as the receiver).

Every figure is a median of repeated wall-clock timings (time.perf_counter) in this process,
with torch limited to `threads` threads (the transport's processes use
`transport.threads`). The real text the prompts are made of comes from `kvsim.kv.text`, with
a seed of its own: calibration never reads a validation run's results.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvsim.core.layout import KVShape
from kvsim.model.forward import lm_forward

PROFILE_VERSION = 1


@dataclass
class ModelCalibration:
    """What to measure (counts are repeats; times are medians over them)."""

    contexts: list[int]  # prompt lengths (tokens) for prefill, decode steps and codecs
    steps: int = 12  # decode steps timed per context (after the first)
    repeats: int = 3  # prefill repeats at the shortest context (1 at the longest)
    batches: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)  # decode batch sizes, at every context
    drafted: tuple[int, ...] = (1, 2, 4, 8, 16)  # drafted tokens per verification pass
    codec_repeats: int = 3
    text_source: str = "stdlib-docs"
    seed: int = 1009  # of the calibration prompts (the validation's use workload seeds)


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def _prompt(lm: Any, tokens: int, cal: ModelCalibration) -> list[int]:
    from kvsim.kv.text import assemble

    return list(assemble(lm.tokenizer, tokens, cal.text_source, cal.seed + tokens).ids)


def _dtype(lm: Any) -> torch.dtype:
    return next(lm.model.parameters()).dtype


@torch.no_grad()
def _steps_s(lm: Any, cache: Any, token: int, steps: int) -> tuple[float, list[float]]:
    """(first step s, [steps] later step times s) of greedy decoding on `cache`."""
    model = lm.model
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        out = lm_forward(model, torch.tensor([[token]]), cache)
        token = int(out.logits[0, -1].argmax())
        times.append(time.perf_counter() - t0)
    return times[0], times[1:]


def batch_stepper(lm: Any, kv: torch.Tensor, batch: int) -> Callable[[], Any]:
    """One decode step (a call; no gradients kept) of `batch` copies of the cache kv
    [layers, 2, kv_heads, tokens, head_dim], in the model's dtype; each call appends a
    token to every copy."""
    from transformers import DynamicCache

    dtype = _dtype(lm)
    data = [(kv[layer, 0][None].expand(batch, -1, -1, -1).to(dtype).contiguous(),
             kv[layer, 1][None].expand(batch, -1, -1, -1).to(dtype).contiguous())
            for layer in range(kv.shape[0])]
    cache = DynamicCache(data, config=lm.model.config)
    ids = torch.ones((batch, 1), dtype=torch.long)

    @torch.no_grad()
    def step() -> Any:
        return lm_forward(lm.model, ids, cache)
    return step


@torch.no_grad()
def _batch_steps_s(lm: Any, kv: torch.Tensor, batches: tuple[int, ...], steps: int
                   ) -> list[float]:
    """Median decode step (s) of each batch size B in `batches`, B copies of the cache kv
    [layers, 2, h, t, d]. Each size B > 1 is timed beside a lone step (one of each in turn,
    `steps` rounds), so that the host's speed drifting during the measurement moves both
    alike; its entry is the median of its steps over the lone steps beside them, times the
    lone step's median over every round. The ratios are what the simulator uses. Only the
    lone cache and one batched one are held at a time: 1 + B copies of the cache at most,
    where timing every size in one round would hold 1 + 2 + ... + 8 = 36 (a copy at 4,096
    tokens of SmolLM2-135M is 189 MB in float32).

    Every size, not a few to interpolate between: on this 2-core host's BLAS a batch of 3
    costs more than one of 4 (135 / 114 ms at 512 tokens, 196 / 180 at 2,048; 1 to 8 at
    512: 67, 108, 135, 114, 125, 129, 141, 141 ms), so sizes 1, 2 and 4 put a batch of 3
    18% low and held every batch beyond 4 at the cost of 4."""
    def stepper(b: int) -> Callable[[], Any]:
        step = batch_stepper(lm, kv, b)
        step()  # first: slower
        return step

    def timed(step: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    lone = stepper(1)
    lone_s: list[float] = []
    ratio: dict[int, float] = {}
    for b in sorted(set(batches) - {1}):
        batch = stepper(b)
        ratios = []
        for _ in range(steps):
            one = timed(lone)
            lone_s.append(one)
            ratios.append(timed(batch) / one)
        ratio[b] = float(statistics.median(ratios))
        del batch
    if not lone_s:  # batch 1 alone
        lone_s = [timed(lone) for _ in range(steps)]
    one_s = float(statistics.median(lone_s))
    return [one_s if b == 1 else one_s * ratio[b] for b in batches]


@torch.no_grad()
def _verify_ratio(lm: Any, kv: torch.Tensor, drafted: int, repeats: int) -> float:
    """One pass over [first token, d_1..d_n] on a freshly built full cache (as the receiver
    verifies) over one token's step on another freshly built cache timed right after it,
    median over `repeats` pairs. The host's speed moves in spells of seconds (a step at
    1,536 tokens ~80 ms in one, ~105 in the next: CHANGELOG.md, 2026-11-29): a pass and
    the step beside it fall in the same spell, so their ratio holds where the pass alone
    does not (three calibrations on 2026-12-07 timed one draft alone at 141-172 ms at
    1,024 tokens and 145-239 ms at 2,048, against 138 in a quiet minute; one had 142, 172
    and 141 ms for 1, 2 and 4 drafts)."""
    from kvsim.kv.capture import kv_to_cache

    dtype = _dtype(lm)
    ids = torch.ones((1, drafted + 1), dtype=torch.long)
    one = torch.ones((1, 1), dtype=torch.long)
    ratios = []
    for _ in range(max(1, repeats)):
        times = []
        for tokens in (ids, one):
            cache = kv_to_cache(kv, lm.model.config, dtype)
            t0 = time.perf_counter()
            lm_forward(lm.model, tokens, cache)
            times.append(time.perf_counter() - t0)
        ratios.append(times[0] / times[1])
    return float(statistics.median(ratios))


def measure_model(lm: Any, model_name: str, cal: ModelCalibration,
                  progress: Callable[[str], None] = lambda msg: None,
                  ) -> tuple[dict, dict[int, torch.Tensor]]:
    """The hardware profile document of the real model here, and the real bf16 KV
    [layers, 2, kv_heads, tokens, head_dim] of each calibration context (for the codecs)."""
    from kvsim.calibrate.step_fit import fitted_curve
    from kvsim.kv.capture import cache_to_kv, kv_to_cache, prefill

    contexts = sorted({int(c) for c in cal.contexts})
    if not contexts or contexts[0] < 16:
        raise ValueError(f"calibration contexts must be >= 16 tokens, got {cal.contexts}")
    dtype = _dtype(lm)
    prefill_s, tpot_s, first_extra_s, kvs = [], [], [], {}
    for i, ctx in enumerate(contexts):
        ids = _prompt(lm, ctx, cal)
        prefill(lm.model, ids[:64])  # warm: allocator and kernels, not timed
        repeats = cal.repeats if i == 0 else max(1, cal.repeats - 1 - (i == len(contexts) - 1))
        out: dict[str, Any] = {}

        def run(ids: list[int] = ids, out: dict = out) -> None:
            out["cache"], out["logits"] = prefill(lm.model, ids)

        prefill_s.append(_median_s(run, repeats))
        kv = cache_to_kv(out["cache"]).to(torch.bfloat16).contiguous()
        kvs[ctx] = kv
        first_token = int(torch.argmax(out["logits"]))
        cache = kv_to_cache(kv.float(), lm.model.config, dtype)  # as the receiver builds it
        first, later = _steps_s(lm, cache, first_token, cal.steps)
        step = float(statistics.median(later))
        tpot_s.append(step)
        first_extra_s.append(max(0.0, first - step))
        progress(f"context {ctx}: prefill {prefill_s[-1]:.3f} s, decode step {step * 1e3:.1f} "
                 f"ms (first +{first_extra_s[-1] * 1e3:.1f} ms)")
    # the batched step at every context: its ratio to a step grows with the context (the
    # weights, read once per step, weigh less against the members' KV and attention)
    batch_s = []
    for ctx in contexts:
        # (each size's ratio a median of paired steps: half the rounds of a lone step's)
        batch_s.append(_batch_steps_s(lm, kvs[ctx], tuple(cal.batches),
                                      max(4, cal.steps // 2)))
        progress(f"batch {list(cal.batches)} at {ctx}: " +
                 ", ".join(f"{s * 1e3:.1f}" for s in batch_s[-1]) + " ms per step")
    # the verification pass at every context, as its ratio to a first step on a fresh cache
    # timed beside it (_verify_ratio; the ratio changes with the context) times that step
    # here: the fitted decode step + the first step's extra
    tpot = fitted_curve({"context_tokens": contexts, "s": tpot_s})
    verify_s, verify_ratio = [], []
    for i, ctx in enumerate(contexts):
        verify_ratio.append([_verify_ratio(lm, kvs[ctx].float(), n, cal.codec_repeats)
                             for n in cal.drafted])
        fresh_s = tpot["s"][i] + first_extra_s[i]
        verify_s.append([fresh_s * r for r in verify_ratio[-1]])
        progress(f"verify {list(cal.drafted)} drafts at {ctx}: " +
                 ", ".join(f"{s * 1e3:.1f}" for s in verify_s[-1]) + " ms (" +
                 ", ".join(f"{r:.2f}" for r in verify_ratio[-1]) + " x a fresh step of "
                 f"{fresh_s * 1e3:.1f} ms)")
    doc = {
        "version": PROFILE_VERSION, "kind": "hardware", "model": model_name,
        "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
        "prefill": {"tokens": contexts, "s": prefill_s},
        # fitted over context (kvsim.calibrate.step_fit), the medians under "measured"
        "tpot": tpot,
        "first_step_extra": {"context_tokens": contexts, "s": first_extra_s},
        "tpot_batch": {"context_tokens": contexts, "batch": list(cal.batches), "s": batch_s},
        "verify": {**fitted_curve({"context_tokens": contexts,
                                   "drafted_tokens": list(cal.drafted), "s": verify_s}),
                   # [context][drafted] the pass over a first step beside it (median)
                   "ratio_to_first_step": verify_ratio},
    }
    return doc, kvs


def _encode_layerwise(codec: Any, kv: torch.Tensor) -> list[Any]:
    """Encode layer by layer and checksum every payload, as the sender does."""
    from kvsim.transport.protocol import payload_crc

    out = []
    for layer in range(kv.shape[0]):
        enc = codec.encode(kv[layer:layer + 1])
        for chunks in enc.streams:
            for c in chunks:
                payload_crc(c.payload)
        out.append(enc)
    return out


def _load(codec: Any, enc: Any, n: int, lm: Any) -> Any:
    """Dequantize the first n streams and build the model's cache, as the receiver does."""
    from kvsim.core.layout import all_finite
    from kvsim.kv.capture import kv_to_cache

    kv = codec.decode(enc, streams=n, dtype=torch.float32)
    if not all_finite(kv):
        raise RuntimeError(f"{codec.name}: calibration KV decodes to non-finite values")
    return kv_to_cache(kv, lm.model.config, _dtype(lm))


def measure_codecs(lm: Any, specs: list[Any], kv: torch.Tensor, repeats: int,
                   command: str, progress: Callable[[str], None] = lambda msg: None) -> dict:
    """A codec timing document (kvsim.scenario.codec_timing's format) of each codec spec on the
    real KV `kv` [layers, 2, kv_heads, tokens, head_dim] bf16: encode GB/s of bf16 input as
    the sender encodes (layer by layer + checksum), decode GB/s as the receiver loads all
    streams, and for split-stream codecs anchor_decode GB/s (stream 0 alone)."""
    from kvsim.scenario.codec_timing import FORMAT_VERSION

    shape = KVShape.of(kv)
    bf16_bytes = float(kv.numel() * 2)
    codecs: dict[str, dict] = {}
    for spec in specs:
        codec = spec.build()
        _encode_layerwise(codec, kv[:1])  # JIT / first-use costs, not timed
        encode_s = _median_s(lambda codec=codec: _encode_layerwise(codec, kv), repeats)
        enc = codec.encode(kv)
        _load(codec, enc, codec.num_streams, lm)
        decode_s = _median_s(lambda codec=codec, enc=enc: _load(codec, enc, codec.num_streams,
                                                                 lm), repeats)
        entry = {"encode_gb_per_s": bf16_bytes / encode_s / 1e9,
                 "decode_gb_per_s": bf16_bytes / decode_s / 1e9,
                 "source": "measured", "command": command, "device": "cpu",
                 "threads": torch.get_num_threads(),
                 "shape": {"layers": shape.layers, "kv_heads": shape.kv_heads,
                           "tokens": shape.tokens, "head_dim": shape.head_dim},
                 "what": "encode: layer by layer + payload CRC32C (the sender); decode: "
                         "dequantize the streams + build the model's cache (the receiver)"}
        if codec.num_streams > 1:
            anchor_s = _median_s(lambda codec=codec, enc=enc: _load(codec, enc, 1, lm), repeats)
            entry["anchor_decode_gb_per_s"] = bf16_bytes / anchor_s / 1e9
        codecs[spec.label] = entry
        progress(f"codec {spec.label}: encode {entry['encode_gb_per_s']:.3f} GB/s, load "
                 f"{entry['decode_gb_per_s']:.3f} GB/s" +
                 (f", anchor load {entry['anchor_decode_gb_per_s']:.3f} GB/s"
                  if "anchor_decode_gb_per_s" in entry else ""))
    return {"version": FORMAT_VERSION, "hardware": "calibrated", "codecs": codecs}
