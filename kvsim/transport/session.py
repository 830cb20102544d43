"""From a scenario config to the two ends of a real transfer: the sender's requests (KV source,
codec, policy, arrivals) and the receiver's decoders (real model or timing model), plus the
printed table. Shared by `kvsim serve`, `kvsim send` and `kvsim emulate`."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.core.report import format_table
from kvsim.kernels import wire
from kvsim.model.forward import lm_forward
from kvsim.model.hardware_profile import INGEST_S_PER_BYTE_MAX
from kvsim.model.spec import ModelSpec
from kvsim.scenario.codec_timing import load_codec_timing
from kvsim.scenario.link_profile import link_draft_step
from kvsim.scenario.speculative import draft_overhead_s, receiver_busy_draft_s, receiver_draft_s
from kvsim.scenario.timing_model import TimingModel
from kvsim.scenario.variants import variants
from kvsim.scenario.workload import requests as workload_requests
from kvsim.transport import protocol as P
from kvsim.transport.assembly import Assembly
from kvsim.transport.config import EmulateConfig
from kvsim.transport.decode_batch import ContinuousBatch, DecodeInstances, StepBatch
from kvsim.transport.prefill_instances import PrefillInstances
from kvsim.transport.rate_limiter import TokenBucket, Unlimited
from kvsim.transport.receiver import ReceiverSettings
from kvsim.transport.record import emulated_row
from kvsim.transport.routing import instance_routing
from kvsim.transport.sender import OutgoingRequest
from kvsim.transport.source import (
    capture_source,
    live_source,
    reused_live_source,
    synthetic_source,
)


def weights_available(model: ModelSpec) -> bool:
    """Whether real weights for the model preset are on this machine (fetched, a path, or a
    random-init preset's)."""
    from kvsim.model.load import locate_weights

    if model.random_init:
        return True
    try:
        locate_weights(model)
        return True
    except (FileNotFoundError, ValueError):
        return False


def _real_model_here(cfg: EmulateConfig) -> bool:
    """What `auto` resolves by: the model's weights are here and time runs unscaled."""
    return cfg.transport.time_scale == 1 and weights_available(cfg.model)


def decode_mode(cfg: EmulateConfig) -> str:
    if cfg.transport.decode != "auto":
        return cfg.transport.decode
    return "real" if _real_model_here(cfg) else "timing"


def source_kind(cfg: EmulateConfig) -> str:
    if cfg.transport.kv_source != "auto":
        return cfg.transport.kv_source
    return "live" if _real_model_here(cfg) else "synthetic"


def kv_device(cfg: EmulateConfig) -> Any:
    """cfg.device resolved (kvsim.core.device): where this end's KV cache lives and its
    model runs. ValueError for a device this host lacks, or a setting a device cannot
    serve yet."""
    from kvsim.core.device import resolve_device

    device = resolve_device(cfg.device)
    if device.type == "cuda" and cfg.prefix_cache.enabled:
        raise ValueError(f"prefix_cache.enabled: the transport's prefix store keeps its "
                         f"blocks in host memory; it is not built for device={cfg.device} "
                         f"(use device=cpu)")
    return device


def load_model(cfg: EmulateConfig) -> Any:
    from kvsim.model.load import load_lm

    lm = load_lm(cfg.model, threads=cfg.transport.threads, seed=cfg.seed,
                 device=kv_device(cfg))
    shape = cfg.model.kv_shape(8)
    meta = lm.meta
    if (meta["layers"], meta["kv_heads"], meta["head_dim"]) != (shape.layers, shape.kv_heads,
                                                              shape.head_dim):
        raise ValueError(f"model={cfg.model.name} has KV {shape.layers}x{shape.kv_heads}x"
                         f"{shape.head_dim} but the weights of {lm.name} have "
                         f"{meta['layers']}x{meta['kv_heads']}x{meta['head_dim']}")
    return lm


# the decode side's warm-up touches at most this much memory (see _reach_peak_memory)
PEAK_WARM_UP_MAX_BYTES = 4 << 30


def warm_up(cfg: EmulateConfig, lm: Any | None, decode_side: bool = False) -> None:
    """Compile and fault in everything a timed request would otherwise pay for on first use:
    each codec's JIT kernels (numba, or Triton on a CUDA device) on a small cache of the
    model's shape, encode and decode on cfg.device, and one forward of the real model; on
    the decode side also the memory of the largest request's cache
    (kvsim.transport.memory). Called before listening / sending."""
    import torch

    from kvsim.core.device import synchronize
    from kvsim.kv.synthetic import generate_kv

    device = kv_device(cfg)
    shape = cfg.model.kv_shape(min(cfg.workload.context_tokens, 512))
    kv = generate_kv(replace(shape, layers=1)).to(device)
    for v in variants(cfg):
        codec = v.spec.build()
        codec.decode(codec.encode(kv), dtype=torch.float32, device=device)
        if codec.num_streams > 1:
            codec.decode(codec.encode(kv), streams=1, dtype=torch.float32, device=device)
    synchronize(device)
    if lm is not None:
        from kvsim.kv.capture import prefill

        prefill(lm.model, list(range(1, 65)))
    if decode_side:
        _reach_peak_memory(cfg, lm)


def longest_prompt_tokens(cfg: EmulateConfig) -> int:
    """The workload's longest prompt (tokens): what the decode side warms up for."""
    return max(r.context_tokens for r in
               workload_requests(cfg.workload, np.random.default_rng(cfg.seed)))


def _reach_peak_memory(cfg: EmulateConfig, lm: Any | None) -> None:
    """Allocate, touch and free what the workload's largest request needs at its peak on
    the decode side: its dequantized fp32 layers and, with a real model, the model's caches
    built from them after two decode steps each (a step copies the whole cache one entry
    longer): a split-stream request holds the anchor's and the full one, and batched, its
    row of the batch's cache besides (as many as _cache_copies reserves: the dequantized
    copy it counts is the layers here). With the allocator keeping freed memory
    (`retain_freed_memory`), the timed requests then reuse these pages instead of
    page-faulting fresh ones, as a serving engine's preallocated KV pool would (why:
    kvsim.transport.memory).
    On a CUDA device the same caches are made there: torch's allocator keeps the freed
    blocks for the requests.
    Skipped, with a note, when that is more than PEAK_WARM_UP_MAX_BYTES."""
    import torch

    tokens = longest_prompt_tokens(cfg)
    shape = cfg.model.kv_shape(tokens)
    layer_shape = (2, shape.kv_heads, tokens, shape.head_dim)  # [K/V, heads, tokens, D]
    fp32_bytes = 4 * shape.layers * int(np.prod(layer_shape))
    caches = _cache_copies(cfg) if lm is not None else 0
    peak_bytes = (1 + 2 * caches) * fp32_bytes
    device = kv_device(cfg)
    if peak_bytes > PEAK_WARM_UP_MAX_BYTES:
        cost = "page faults" if device.type == "cpu" else "allocation"
        print(f"kvsim: warm-up leaves the memory of {tokens}-token caches untouched "
              f"({peak_bytes / 2**30:.1f} GiB > {PEAK_WARM_UP_MAX_BYTES / 2**30:.0f} GiB); "
              f"the first requests pay its {cost}", file=sys.stderr)
        return
    # zeroing touches pages
    layers = [torch.zeros(layer_shape, device=device) for _ in range(shape.layers)]
    held = []
    if lm is not None:
        from kvsim.kv.capture import CacheFromLayers

        param = next(lm.model.parameters())
        for _ in range(caches):
            builder = CacheFromLayers(lm.model.config, param.dtype, param.device)
            for i, kv_layer in enumerate(layers):
                builder.add(i, kv_layer.clone())
            held.append(builder.cache())
            with torch.no_grad():
                for _ in range(2):
                    lm_forward(lm.model, torch.ones(1, 1, dtype=torch.long,
                                                    device=param.device), held[-1])
    del layers, held


def _in_flight_ms_bytes(cfg: EmulateConfig) -> float:
    """The bytes the link carries in transport.in_flight_ms at its rate."""
    t = cfg.transport
    return cfg.link.bandwidth_gbps / t.time_scale * 1e9 / 8 * t.in_flight_ms / 1e3


def _rate_capped(cfg: EmulateConfig) -> bool:
    """Whether the sender keeps link rate x transport.in_flight_ms unacknowledged (a setting
    of 0 turns it off): over `tc`, where what it has in flight waits in the shaper's FIFO
    ahead of the chunks it sends later. The token bucket hands a chunk to the socket once
    it has crossed the emulated link (less `burst_bytes`' lead), so what it has in flight is
    ahead of nothing where the path below it is faster than its rate (loopback; a `kvsim
    send` over a slower network queues there: lower transport.window_bytes for it). An
    unshaped link has no rate to keep."""
    return bool(cfg.transport.in_flight_ms) and cfg.transport.emulation == "tc"


def max_in_flight_bytes(cfg: EmulateConfig) -> int:
    """The sender's cap on unacknowledged bytes. Where rate-capped (_rate_capped): link rate
    x transport.in_flight_ms, at least 1 MiB (a few chunks, so ACK latency does not throttle
    the link), at most the window, so that a better chunk waits behind little. Elsewhere
    nothing in flight is ahead of a later chunk, and a shorter cap than the receiver's window
    would only idle the link whenever the receiver, sharing the host's cores with the sender
    and the decoder, acknowledges late (CHANGELOG.md, 2026-12-07)."""
    t = cfg.transport
    if not _rate_capped(cfg):
        return t.window_bytes
    return int(min(t.window_bytes, max(1 << 20, _in_flight_ms_bytes(cfg))))


def behind_in_flight_bytes(cfg: EmulateConfig) -> int:
    """The sender's cap on unacknowledged bytes when the next chunk is a later stream's
    (a residual) and its request is still being encoded (Sender's behind_in_flight_bytes):
    over `tc`, link rate x transport.in_flight_ms without max_in_flight_bytes' 1 MiB floor,
    so a residual in the shaper's FIFO queue holds the anchor back at most that long.
    Elsewhere: the full cap."""
    full = max_in_flight_bytes(cfg)
    if not _rate_capped(cfg):
        return full
    return int(min(full, _in_flight_ms_bytes(cfg)))


def limiter_for(cfg: EmulateConfig) -> Any:
    if cfg.transport.emulation == "token_bucket":
        return TokenBucket(cfg.link.bandwidth_gbps / cfg.transport.time_scale,
                           cfg.transport.burst_bytes)
    return Unlimited()  # tc shapes the veth below us; none is unshaped


# ---- sender side --------------------------------------------------------------------------
def outgoing_requests(cfg: EmulateConfig, lm: Any | None, resume: ResumePlan | None = None
                      ) -> list[list[OutgoingRequest]]:
    """One list of requests per (codec, transfer) variant, each replaying the workload's
    arrivals (the simulator's generator with the same seed); a resumed run's requests take
    the ids of `resume` (None: cfg.resume's plan, if any)."""
    kind = source_kind(cfg)
    if kind == "live" and lm is None:
        raise ValueError("kv_source=live needs the model loaded")
    # the draft step measured on the emulated link, where link.profile names its profile
    timing = TimingModel(cfg.model, cfg.hardware, link_draft_step(
        cfg.link.profile, cfg.model.name, cfg.hardware.profile, cfg.transport.emulation))
    reqs = workload_requests(cfg.workload, np.random.default_rng(cfg.seed))
    if any(r.output_tokens != cfg.workload.output_tokens for r in reqs):
        raise ValueError("the transport decodes workload.output_tokens tokens for every "
                         "request; a trace file's own GeneratedTokens per request are "
                         "simulated only (kvsim sim), not emulated")
    if resume is None and cfg.resume:
        resume = resume_plan(cfg.resume)
    resumed = dict(resume.ids) if resume is not None else {}
    device = kv_device(cfg)
    out = []
    timing_table = load_codec_timing(cfg.hardware.name, cfg.codec_timing or None)
    for vi, v in enumerate(variants(cfg)):
        codec = v.spec.build()
        codec_timing = timing_table.lookup(v.spec.label, v.spec.name)
        batch = []
        for r in reqs:
            # 128 random bits; a resumed run takes the id its earlier run drew
            rid = resumed.pop((vi, r.seq), None) or P.new_request_id()
            sizes = codec.size_table(cfg.model.kv_shape(r.context_tokens))
            hello = {"model": cfg.model.name, "seq": r.seq,
                     "output_tokens": cfg.workload.output_tokens,
                     "cap_tokens": cfg.speculative.cap_tokens, "ks": list(cfg.metrics.ks),
                     "breakdown_k": cfg.metrics.breakdown_k,
                     # the curve itself: the decode host opens no file a peer names
                     "acceptance": inline_acceptance(v.acceptance or
                                                     cfg.speculative.acceptance),
                     "variant": vi,
                     # the simulator's per-drafted-token overhead for this request
                     "draft_overhead_s": draft_overhead_s(
                         cfg.speculative.draft_overhead_s, codec_timing,
                         cfg.model.kv_bytes_bf16(r.context_tokens),
                         float(sizes.chunk_bytes[0].sum()) + sizes.header_bytes,
                         float(sizes.total_bytes), cfg.hardware.devices,
                         receiver_draft_s(cfg.transport.dequantize, timing,
                                          r.context_tokens)),
                     # ... and, where the profile measured it, a draft step's extra while
                     # the on-arrival worker is busy (the timing decode follows the worker)
                     "busy_draft_overhead_s": receiver_busy_draft_s(
                         cfg.transport.dequantize, cfg.speculative.draft_overhead_s, timing,
                         r.context_tokens),
                     # ... which the later streams' bytes add to (s of receiver time per
                     # byte taken in: the link profile's, kvsim.calibrate.draft_ingest)
                     "ingest_s_per_byte": timing.draft_ingest_s_per_byte(),
                     "bandwidth_gbps": cfg.link.bandwidth_gbps,
                     "link_emulation": cfg.transport.emulation,
                     "time_scale": cfg.transport.time_scale}
            if cfg.prefix_cache.enabled:  # the decode node may hold its leading blocks
                hello["prefix"] = {"blocks": list(r.prefix_blocks),
                                   "block_tokens": cfg.prefix_cache.block_tokens}
            batch.append(OutgoingRequest(rid, r.seq, r.arrival_t, codec, v.spec.label, v.policy,
                                         _source_maker(cfg, kind, lm, timing, r.context_tokens,
                                                       r.seq, device), hello))
        out.append(batch)
    return out


def _source_maker(cfg: EmulateConfig, kind: str, lm: Any, timing: TimingModel,
                  context_tokens: int, seq: int, device: Any):
    """The request's KV source, made when it arrives (a live one on the model's device; a
    capture or synthetic KV moved to `device`)."""
    seed = cfg.seed + seq
    if kind == "live":
        from kvsim.kv.text import assemble

        # the prompt is tokenized before the request arrives (the simulator's arrival is a
        # tokenized request); only the prefill itself runs (timed) at arrival
        sample = assemble(lm.tokenizer, context_tokens, cfg.transport.text_source, seed)
        source = reused_live_source if cfg.transport.reuse_prefill else live_source
        return lambda: source(lm, sample.ids, {"text_sha256": sample.sha256})
    modelled_s = timing.prefill_s(context_tokens) * cfg.transport.time_scale
    if kind == "capture":
        return lambda: capture_source(cfg.transport.capture, modelled_s, device)
    shape = cfg.model.kv_shape(context_tokens)
    return lambda: synthetic_source(shape, modelled_s, seed, device)


# ---- receiver side ------------------------------------------------------------------------
def _cache_copies(cfg: EmulateConfig) -> int:
    """fp32 copies of a request's cache its decoding holds at its peak: the dequantized
    one (timing-model decode: that alone); real decoding, the model's cache built from it
    too; batched real decoding, its row of the batch's cache besides
    (kvsim.transport.model_batch: a copy; its padding to the batch's longest member is not
    reserved, nor the old batch beside the new one while the rows are rebuilt)."""
    if decode_mode(cfg) != "real":
        return 1
    return 3 if cfg.workload.decode_max_batch > 1 else 2


def receiver_settings(cfg: EmulateConfig, bind: str) -> ReceiverSettings:
    t = cfg.transport
    return ReceiverSettings(bind=bind, model=cfg.model.name, timeout_s=t.timeout_s,
                            heartbeat_s=t.heartbeat_s, window_bytes=t.window_bytes,
                            max_request_bytes=t.max_request_bytes,
                            max_active_requests=t.max_active_requests,
                            max_requests_per_peer=t.max_requests_per_peer,
                            max_memory_bytes=t.max_memory_bytes,
                            cache_copies=_cache_copies(cfg),
                            request_deadline_s=t.request_deadline_s,
                            max_requests=t.max_requests, idle_exit_s=t.idle_exit_s,
                            dequantize=t.dequantize, keys=t.keys, insecure=t.insecure,
                            prefix_store_bytes=_prefix_store_bytes(cfg),
                            device=str(kv_device(cfg)),
                            max_device_memory_bytes=t.max_device_memory_bytes)


def _prefix_store_bytes(cfg: EmulateConfig) -> int:
    """The decode node's prefix store (0: none): prefix_cache.decode_capacity_gb, or (null)
    the receiver's whole memory budget, which it shares with the requests in progress."""
    pc = cfg.prefix_cache
    if not pc.enabled:
        return 0
    if pc.decode_capacity_gb is not None:
        return int(pc.decode_capacity_gb * 1e9)
    from kvsim.transport.receiver import physical_memory_bytes

    return cfg.transport.max_memory_bytes or physical_memory_bytes() // 2


def inline_acceptance(name_or_path: str) -> dict:
    """An acceptance model as a HELLO carries it: its name and survival curve (loaded here,
    on the sender, from its own configuration)."""
    from kvsim.scenario.acceptance import load_acceptance

    model = load_acceptance(name_or_path)
    return {"name": model.name, "survival": [float(x) for x in model.survival]}


MAX_SURVIVAL_POINTS = 4096


def acceptance_from_hello(doc: Any) -> Any:
    """The AcceptanceModel a HELLO carries inline ({"name", "survival"}), checked; never a
    name or a path (ValueError: the decode host opens no file a peer names)."""
    from kvsim.scenario.acceptance import AcceptanceModel

    if not isinstance(doc, dict) or set(doc) != {"name", "survival"}:
        raise ValueError("acceptance must be an inline curve {name, survival}, not a name "
                         "or a path")
    name, survival = doc["name"], doc["survival"]
    if not isinstance(name, str) or len(name) > 64:
        raise ValueError("acceptance name must be a string of at most 64 characters")
    if not isinstance(survival, list) or not 1 <= len(survival) <= MAX_SURVIVAL_POINTS or \
            not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in survival):
        raise ValueError(f"acceptance survival must be 1..{MAX_SURVIVAL_POINTS} numbers")
    return AcceptanceModel(name, [float(x) for x in survival], "inline")


@dataclass(frozen=True)
class ResumePlan:
    """What an earlier `kvsim send` run left to resume."""

    # (variant, arrival seq) -> request id, for every request it did not complete
    ids: dict[tuple[int, int], int]
    # variant -> the sender routing id its requests belong to on the decode host (a request
    # belongs to the peer that opened it: the resumed run presents the same one)
    identities: dict[int, bytes]


def resume_plan(resume: str) -> ResumePlan:
    """From that run's report (report=PATH) or one id (32 hex digits: the first request; the
    same peer then only where it keeps its routing id, i.e. its CURVE key)."""
    import json
    from pathlib import Path

    path = Path(resume)
    if not path.is_file():
        try:
            return ResumePlan({(0, 0): P.parse_id(resume)}, {})
        except ValueError:
            raise ValueError(f"resume={resume!r} is neither a report file nor a request id "
                             "(32 hex digits)") from None
    ids, identities = {}, {}
    try:
        for r in json.loads(path.read_text())["rows"]:
            if r.get("status") == "done" or "variant" not in r:
                continue
            ids[(int(r["variant"]), int(r["seq"]))] = P.parse_id(str(r["request_id"]))
            if r.get("sender_id"):
                identities[int(r["variant"])] = bytes.fromhex(str(r["sender_id"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"resume={resume}: not a kvsim send report ({exc})") from None
    if not ids:
        raise ValueError(f"resume={resume}: the report has no unfinished request to resume")
    return ResumePlan(ids, identities)


def decoder_factory(cfg: EmulateConfig, mode: str, lm: Any | None):
    from kvsim.scenario.acceptance import load_acceptance
    from kvsim.transport.decode_loop import RealDecodeLoop, TimingDecodeLoop

    # the decode loops' step times (draft costs come with each request's HELLO, from
    # outgoing_requests' timing model with the link profile's draft step)
    timing = TimingModel(cfg.model, cfg.hardware)
    # a HELLO without a curve: this decode host's own configuration's
    own_acceptance = load_acceptance(cfg.speculative.acceptance)
    instances = decode_instances(cfg, mode, timing, lm)

    def make(hello: dict, asm: Assembly):
        if mode == "real":
            batch = instances.assign()
            return RealDecodeLoop(lm.model, int(hello["first_token"]), clock=time.time,
                                  batch=batch if batch.max_batch > 1 else None, slots=batch,
                                  on_done=lambda: instances.done(batch)), {}
        acceptance = acceptance_from_hello(hello.get("acceptance")) \
            if hello.get("acceptance") is not None else own_acceptance
        rng = np.random.default_rng([cfg.seed, int(hello.get("seq", 0))])
        overhead = float(hello.get("draft_overhead_s") or 0.0)
        # routed last: a HELLO that fails above holds no instance
        batch = instances.assign()
        return TimingDecodeLoop(timing, asm.shape.tokens, acceptance, rng,
                                time_scale=float(hello.get("time_scale") or 1.0),
                                draft_overhead_s=overhead, clock=time.time, sleep=asm.sleep,
                                busy_draft_overhead_s=hello.get("busy_draft_overhead_s"),
                                ingest_s_per_byte=float(hello.get("ingest_s_per_byte") or 0.0),
                                batch=batch if batch.max_batch > 1 else None, slots=batch,
                                on_done=lambda: instances.done(batch)), {}
    return make


def decode_instances(cfg: EmulateConfig, mode: str, timing: TimingModel,
                     lm: Any | None = None) -> DecodeInstances:
    """The decode host's continuous batches (kvsim.transport.decode_batch):
    workload.decode_nodes instances of up to workload.decode_max_batch requests each (routed
    by workload.routing), every member stepping with the others, a request beyond an
    instance's slots waiting for one, as the simulator's decode instances do. Timing-model
    decoding sleeps each batched step's modelled length (StepBatch); real decoding runs one
    forward of `lm`'s model over the batch per step (ModelBatch)."""
    w = cfg.workload
    batch_kw = dict(clock=time.time, wait_timeout_s=cfg.transport.request_deadline_s,
                    log=lambda msg: print(f"kvsim serve: {msg}", file=sys.stderr))
    if mode == "timing":
        def make_batch() -> ContinuousBatch:
            return StepBatch(timing, int(w.decode_max_batch), **batch_kw)
    else:
        if lm is None:
            raise ValueError("real decoding needs the model (transport.decode=real)")
        from kvsim.transport.model_batch import ModelBatch  # torch: only where it decodes

        def make_batch() -> ContinuousBatch:
            return ModelBatch(lm.model, int(w.decode_max_batch), **batch_kw)
    return DecodeInstances(make_batch, int(w.decode_nodes), routing=instance_routing(w.routing))


def prefill_instances(cfg: EmulateConfig) -> PrefillInstances:
    """The prefill host's instances (kvsim.transport.prefill_instances): one sender run's
    requests queue for workload.prefill_nodes of them, routed by workload.routing."""
    w = cfg.workload
    return PrefillInstances(int(w.prefill_nodes), instance_routing(w.routing),
                            wait_timeout_s=cfg.transport.request_deadline_s)


def hello_checker(cfg: EmulateConfig, mode: str, vocab_size: int | None = None):
    """What this decode node needs of a request beyond the codec: a real decode needs the
    model's KV shape and the prefill's first token (within vocab_size, the model's, where
    given); output / cap within bounds."""
    want = cfg.model.kv_shape(8)

    def check(hello: dict, shape: KVShape) -> str:
        scale = hello.get("time_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
                not 1 <= scale <= 1e4:
            return f"time_scale must be a number in [1, 10000], got {scale!r}"
        if mode == "real":
            if scale != 1:
                return "time_scale != 1 needs the timing-model decode; this node decodes for real"
            if (shape.layers, shape.kv_heads, shape.head_dim) != (want.layers, want.kv_heads,
                                                                   want.head_dim):
                return (f"KV shape {shape.layers}x{shape.kv_heads}x{shape.head_dim} differs from "
                        f"this decode node's model {cfg.model.name} ({want.layers}x"
                        f"{want.kv_heads}x{want.head_dim})")
            first = hello.get("first_token")
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                return "a real decode needs the prefill's first_token (a live or captured KV)"
            if vocab_size is not None and first >= vocab_size:
                # (fed to a forward its batch shares: it would fail every member's step)
                return f"first_token {first} is beyond the model's vocabulary ({vocab_size})"
        out_tokens = hello.get("output_tokens")
        if isinstance(out_tokens, bool) or not isinstance(out_tokens, int) or \
                not 1 <= out_tokens <= 65536:
            return f"output_tokens must be an integer in 1..65536, got {out_tokens!r}"
        cap = hello.get("cap_tokens", 0)
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= 4096:
            return f"cap_tokens must be an integer in 0..4096, got {cap!r}"
        busy = hello.get("busy_draft_overhead_s")
        if busy is not None and (isinstance(busy, bool) or not isinstance(busy, (int, float))
                                 or not 0 <= busy <= 3600):
            return f"busy_draft_overhead_s must be null or a number of s in [0, 3600], got " \
                f"{busy!r}"
        ingest = hello.get("ingest_s_per_byte", 0.0)
        if isinstance(ingest, bool) or not isinstance(ingest, (int, float)) or \
                not 0 <= ingest <= INGEST_S_PER_BYTE_MAX:  # as a profile's (kvsim.model.hardware)
            return f"ingest_s_per_byte must be a number of s in [0, " \
                f"{INGEST_S_PER_BYTE_MAX:g}], got {ingest!r}"
        overhead = hello.get("draft_overhead_s", 0.0)
        if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or \
                not 0 <= overhead <= 3600:
            return f"draft_overhead_s must be a number of s in [0, 3600], got " \
                f"{str(overhead)[:20]}"
        for key in ("codec_label", "model", "link_emulation", "policy"):
            text = hello.get(key, "")
            if not isinstance(text, str) or len(text) > 128:
                return f"{key} must be a string of at most 128 characters"
        bandwidth = hello.get("bandwidth_gbps", 0.0)
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or \
                not 0 <= bandwidth <= 1e6:
            return "bandwidth_gbps must be a number in [0, 1e6]"
        breakdown = hello.get("breakdown_k")
        if breakdown is not None and (isinstance(breakdown, bool) or
                                      not isinstance(breakdown, int) or
                                      not 0 <= breakdown <= 65536):
            return "breakdown_k must be null or an integer in 0..65536 (0: auto)"
        if len(wire.canonical_json(hello.get("kv_source") or {})) > 4096:
            return "kv_source must describe the KV in at most 4096 bytes"
        for key in ("seq", "variant"):
            value = hello.get(key, 0)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < 1 << 31):
                return f"{key} must be an integer in [0, 2**31), got {str(value)[:20]}"
        if hello.get("acceptance") is not None:
            try:
                acceptance_from_hello(hello["acceptance"])
            except ValueError as exc:
                return str(exc)[:200]
        ks = hello.get("ks") or []
        if not isinstance(ks, list) or not all(isinstance(k, int) and 1 <= k <= out_tokens
                                               for k in ks):
            return f"ks must be token indices in 1..{out_tokens}, got {ks!r}"
        return ""
    return check


def row_builder(mode: str, device: Any = None, wakeup_held_us: int | None = None):
    """Each request's row, naming this decode node's host, the device its caches were
    dequantized to and decoded on (a torch.device; None: the CPU) and the wake-up latency
    its CPUs were held to (us; None: not held, kvsim.core.wakeup_latency)."""
    from kvsim.core.device import device_label

    where = device_label(device) if device is not None else "cpu"

    def build(asm: Assembly, hello: dict, result: Any, error: str) -> dict:
        return emulated_row(asm, hello, result, error, {
            "decode": mode, "host": os.uname()[1], "decode_device": where,
            "cpu_wakeup_held_us": wakeup_held_us})
    return build


# ---- output -------------------------------------------------------------------------------
def print_rows(rows: list[dict], file=sys.stdout) -> None:
    ok = [r for r in rows if r.get("status") == "done"]
    flat = []
    for r in ok:
        d = {k: v for k, v in r.items() if not isinstance(v, (dict, list))}
        for k, v in (r.get("ttkt_s") or {}).items():
            d[f"tt{k}t"] = v
        for k, v in (r.get("ttkt_committed_s") or {}).items():
            d[f"tt{k}t_c"] = v
        d["mb"] = r["total_bytes"] / 1e6
        d["acc"] = f"{r.get('accepted_tokens', 0)}/{r.get('proposed_tokens', 0)}"
        flat.append(d)
    ks = sorted({int(k) for r in ok for k in (r.get("ttkt_s") or {})} & {32, 64})
    many = any(r.get("requests", 1) > 1 for r in ok)
    for d, r in zip(flat, ok, strict=True):
        pct = r.get("ttft_committed_pct_s") or {}  # committed, as the TTFT column
        d["ttft_p50"], d["ttft_p99"] = pct.get("p50"), pct.get("p99")
    # committed times first (the time a user sees a verified token), as `kvsim sim` prints
    cols = [("codec", "codec", ""), ("transfer", "transfer", ""), ("context_tokens", "ctx", "d"),
            ("bandwidth_gbps", "Gbps", "g"), ("mb", "MB", ".2f"),
            ("goodput_gbps", "goodput Gbps", ".3f"), ("prefill_s", "prefill s", ".3f"),
            ("ttft_committed_s", "TTFT s", ".3f")]
    cols += [(f"tt{k}t_c", f"TT{k}T s", ".3f") for k in ks]
    cols += [("ttft_s", "drafted TTFT s", ".3f")]
    cols += [(f"tt{k}t", f"drafted TT{k}T s", ".3f") for k in ks]
    cols += [("acc", "acc/prop", ""), ("decode", "decode", "")]
    if many:
        cols[1:1] = [("requests", "requests", "d")]
        cols += [("ttft_p50", "TTFT p50", ".3f"), ("ttft_p99", "TTFT p99", ".3f")]
    if flat:
        print("times from request arrival" + (" (means over requests)" if many else "") +
              "; committed: a drafted token counts once verified; drafted: when drafted, as "
              "the seeds count", file=file)
        print(format_table(flat, cols), file=file)
    for req in [*rows, *(x for r in rows for x in r.get("per_request") or [])]:
        if req.get("status") != "done":
            print(f"request {req.get('request_id')} ({req.get('codec')}): {req.get('status')}: "
                  f"{req.get('error')}", file=file)


def trace_of(rows: list[dict]) -> Any:
    """A Chrome trace (the simulator's format) of the rows' spans, times from the first
    request's arrival."""
    from kvsim.scenario.trace import TraceLog

    trace = TraceLog()
    done = [r for r in rows if r.get("trace_spans")]
    if not done:
        return trace
    t0 = min(s[2] for r in done for s in r["trace_spans"])
    for r in done:
        tid = f"{r['codec']}/{r['transfer']}/r{r.get('request_id')}"
        for name, process, a, b in r["trace_spans"]:
            trace.span(name, process, tid, a - t0, b - t0)
    return trace
