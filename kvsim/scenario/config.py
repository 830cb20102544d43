"""Typed configuration of `kvsim sim` / `kvsim bench sim` (Hydra ConfigStore schemas).

Groups: conf/model/*.yaml -> ModelSpec, conf/hardware/*.yaml -> HardwareSpec,
conf/link/*.yaml -> LinkConfig, conf/workload/*.yaml -> WorkloadConfig,
conf/scenario/*.yaml (`# @package _global_` experiment files, also reachable as scenarios/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from kvsim.core.checks import check_choice, check_number, check_trace
from kvsim.model.hardware import HardwareSpec
from kvsim.model.host import DriftConfig
from kvsim.model.spec import ModelSpec

SHARINGS = ("per_prefill", "shared")
SCHEDULINGS = ("anchors_first", "fifo", "weighted", "aging")
TRACE_ORIGINS = ("run", "first_byte")  # = kvsim.sim.link.TRACE_ORIGINS
WORKLOAD_KINDS = ("single", "poisson", "trace", "azure")
ROUTINGS = ("least_loaded", "round_robin", "kv_aware")  # = kvsim.sim.routing.ROUTINGS
EVICTIONS = ("lru",)
# what a `codecs` entry may add to a codec entry (kvsim.scenario.variants)
VARIANT_KEYS = ("transfer", "acceptance")
AZURE_TRACES = ("code", "conv")  # = kvsim.scenario.azure_workload.AZURE_TRACES
AZURE_ARRIVALS = ("trace", "gamma", "poisson")  # = kvsim.scenario.azure_workload
CONTEXT_DISTS = ("fixed", "uniform", "lognormal")
GRANULARITIES = ("page", "layer")
DESERIALIZERS = ("shared", "per_stream", "node", "on_demand", "on_arrival")


@dataclass
class LinkConfig:
    name: str = "link"
    bandwidth_gbps: float = 10.0  # 1e9 bit/s
    latency_s: float = 0.0  # propagation, added to every message
    message_overhead_bytes: float = 0.0  # framing bytes per message on top of its payload
    # a transfer's set-up before its encoder starts (s): the decode side admitting the
    # request (a HELLO / ACCEPT round trip) and the hand-off of its first chunk to the link;
    # from prefill end (policies that send after prefill) or prefill start (with prefill)
    handshake_s: float = 0.0
    # [[t_s, gbps], ...] steps (typed Any: OmegaConf refuses an int in a nested float list;
    # validate() checks the numbers and makes them floats)
    trace: list[Any] = field(default_factory=list)
    # trace times count from: run (the simulation's start) | first_byte (the link's first byte)
    trace_origin: str = "run"
    sharing: str = "per_prefill"  # per_prefill: one egress link per prefill node | shared
    scheduling: str = "anchors_first"  # anchors_first: class = stream | fifo: by request |
    # weighted: stream s gets link share in proportion to residual_weight^s (no starvation)
    residual_weight: float = 0.25  # weighted: 0.25 = anchors 80%, residual 20% when both wait
    # aging: a request's residual goes ahead of the anchors of requests that arrived more
    # than this many seconds after it (0: fifo by request; large: anchors_first)
    residual_age_s: float = 1.0
    # Gbps (1e9 bit/s) of each decode instance's ingress link, shared by every flow to that
    # instance on top of its prefill link (kvsim.sim.ingress); 0 (default): no ingress limit
    decode_ingress_gbps: float = 0.0
    # a measured link profile, name or path (kvsim/profiles.py; kvsim.scenario.link_profile):
    # egress bandwidth x its efficiency, + its latency_s and message_overhead_bytes, and its
    # draft_step (the receiver's, measured on that link) in place of the hardware
    # profile's (kvsim sim, and kvsim emulate's timing-model decode); "": none
    profile: str = ""

    def validate(self) -> None:
        check_choice("link.sharing", self.sharing, SHARINGS)
        check_choice("link.scheduling", self.scheduling, SCHEDULINGS)
        check_number("link.bandwidth_gbps", self.bandwidth_gbps)
        check_number("link.residual_weight", self.residual_weight)
        check_number("link.residual_age_s", self.residual_age_s, strict=False)
        if self.residual_weight > 1.0:
            raise ValueError(f"link.residual_weight must be in (0, 1], got "
                             f"{self.residual_weight!r}")
        check_number("link.latency_s", self.latency_s, strict=False)
        check_number("link.handshake_s", self.handshake_s, strict=False)
        check_number("link.decode_ingress_gbps", self.decode_ingress_gbps, strict=False)
        check_number("link.message_overhead_bytes", self.message_overhead_bytes, strict=False)
        check_trace("link.trace", self.trace)
        self.trace = [[float(t), float(gbps)] for t, gbps in self.trace]
        check_choice("link.trace_origin", self.trace_origin, TRACE_ORIGINS)
        if not isinstance(self.profile, str):
            raise ValueError(f"link.profile must be a profile name or path, got "
                             f"{self.profile!r}")
        if self.profile:  # a missing profile fails here, before any run
            from kvsim.core.profiles import profile_path

            try:
                profile_path("link", self.profile)
            except ValueError as exc:
                raise ValueError(f"link.profile: {exc}") from None


@dataclass
class WorkloadConfig:
    name: str = "single"
    kind: str = "single"  # single | poisson | trace | azure
    context_tokens: int = 16384  # fixed context, or the mean of a distribution
    output_tokens: int = 128  # tokens decoded per request
    requests: int = 1
    rate_per_s: float = 1.0  # Poisson arrival rate
    context_dist: str = "fixed"  # fixed | uniform | lognormal
    context_min_tokens: int = 1024
    context_max_tokens: int = 131072
    context_sigma: float = 0.5  # lognormal shape
    context_round_tokens: int = 256  # sampled contexts are rounded up to this multiple
    arrivals_t: list[float] = field(default_factory=list)  # trace: arrival times (s)
    arrivals_context_tokens: list[int] = field(default_factory=list)  # trace: contexts
    # trace: each request's prefix block ids, a list per request as a Mooncake trace's
    # hash_ids (prefix_cache); empty: none
    arrivals_prefix_blocks: list[list[int]] = field(default_factory=list)
    # trace from a file instead, by path or by the name of a shipped trace (data/traces/:
    # mooncake-conversation, mooncake-synthetic): a CSV of the Azure LLM inference trace
    # columns (TIMESTAMP, ContextTokens, GeneratedTokens) or of BurstGPT's (Timestamp,
    # Request tokens, Response tokens; failed requests left out), or Mooncake JSONL (.jsonl or
    # .jsonl.gz: timestamp ms, input_length, output_length, hash_ids); each request decodes
    # its own output length (kvsim.scenario.request_trace)
    trace_path: str = ""
    trace_start_s: float = 0.0  # replay the trace from this time (s of the trace) ...
    trace_duration_s: float = 0.0  # ... for this long (s of the trace; 0: to its end)
    trace_max_requests: int = 0  # then its first N requests (0: all)
    # arrival gaps x this (0.5: replay at twice the trace's rate)
    trace_time_scale: float = 1.0
    # kind=azure (kvsim.scenario.azure_workload): `requests` requests whose ContextTokens and
    # GeneratedTokens are drawn from the measured shape of an Azure LLM inference trace 2023,
    # data/workload/azure-2023-<azure_trace>.json: code | conv. Contexts are clipped to
    # context_min/max_tokens and rounded up to context_round_tokens (as for lognormal); each
    # request decodes its own drawn GeneratedTokens (output_tokens is not used)
    azure_trace: str = "code"
    # arrivals at rate_per_s (requests/s), a renewal process: trace (default): gaps drawn from
    # the trace's measured inter-arrival distribution scaled to mean 1/rate_per_s (bursty) |
    # gamma: gamma gaps with the trace's inter-arrival CV | poisson: exponential gaps
    azure_arrivals: str = "trace"
    prefill_nodes: int = 1
    decode_nodes: int = 1
    decode_max_batch: int = 64  # concurrent sequences per decode instance
    # tokens per chunked prefill step, prompts batched first come first served
    # (kvsim.sim.prefill_batch); 0 (default): one whole prompt at a time
    prefill_chunk_tokens: int = 0
    # every prefill instance on the decode instances' host, as `kvsim emulate` runs them on
    # one machine (the simulator only; kvsim validate sets it to mirror such a host): a
    # decode step taken while a prefill runs costs the hardware profile's
    # tpot_beside_prefill ratio (timed by kvsim calibrate beside_prefill_tokens=...), a
    # prefill's start and end re-timing the steps in progress (kvsim.sim.batch)
    colocated_prefill: bool = False
    # the decode instances' on-arrival workers (deserializer=on_arrival) dequantize on the
    # processor that steps the batch, as `kvsim serve` runs them in its process (the
    # simulator only; kvsim validate sets it to mirror such a host): while a request is
    # received, a step costs the hardware profile's tpot_beside_worker.extra_s more for
    # the share of the time its worker is busy (timed by kvsim calibrate
    # beside_worker_tokens=...; kvsim.sim.batch); deserializer=on_arrival only
    worker_slows_decode: bool = False
    # which instances a request goes to (kvsim.sim.routing): least_loaded (fewest requests
    # in flight there) | round_robin | kv_aware (the longest prefix held, within
    # routing_load_slack requests of the least loaded; needs prefix_cache.enabled)
    routing: str = "least_loaded"
    routing_load_slack: int = 4  # kv_aware: requests above the least loaded instance, at most

    def validate(self) -> None:
        check_choice("workload.kind", self.kind, WORKLOAD_KINDS)
        check_choice("workload.routing", self.routing, ROUTINGS)
        if isinstance(self.routing_load_slack, bool) or \
                not isinstance(self.routing_load_slack, int) or self.routing_load_slack < 0:
            raise ValueError(f"workload.routing_load_slack must be an integer >= 0, got "
                             f"{self.routing_load_slack!r}")
        check_number("workload.trace_start_s", self.trace_start_s, strict=False)
        check_number("workload.trace_duration_s", self.trace_duration_s, strict=False)
        if self.arrivals_prefix_blocks and \
                len(self.arrivals_prefix_blocks) != len(self.arrivals_t):
            raise ValueError(f"workload.arrivals_prefix_blocks has "
                             f"{len(self.arrivals_prefix_blocks)} entries for "
                             f"{len(self.arrivals_t)} arrivals_t; give one list per request")
        check_choice("workload.context_dist", self.context_dist, CONTEXT_DISTS)
        for key in ("context_tokens", "output_tokens", "requests", "prefill_nodes",
                    "decode_nodes", "decode_max_batch", "context_round_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"workload.{key} must be >= 1, got {getattr(self, key)}")
        if isinstance(self.prefill_chunk_tokens, bool) or \
                not isinstance(self.prefill_chunk_tokens, int) or self.prefill_chunk_tokens < 0:
            raise ValueError(f"workload.prefill_chunk_tokens must be an integer >= 0 (0: off), "
                             f"got {self.prefill_chunk_tokens!r}")
        for key in ("colocated_prefill", "worker_slows_decode"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"workload.{key} must be true or false, got "
                                 f"{getattr(self, key)!r}")
        if self.colocated_prefill and self.prefill_chunk_tokens:
            raise ValueError("workload.colocated_prefill times whole prompts' prefills beside "
                             "the decode steps; chunked prefill (workload.prefill_chunk_tokens"
                             f"={self.prefill_chunk_tokens}) is not modelled with it: set it 0")
        check_number("workload.rate_per_s", self.rate_per_s)
        check_number("workload.context_sigma", self.context_sigma)
        for key in ("context_min_tokens", "context_max_tokens"):
            check_number(f"workload.{key}", getattr(self, key), minimum=1, strict=False)
        if self.context_min_tokens > self.context_max_tokens:
            raise ValueError(f"workload.context_min_tokens ({self.context_min_tokens}) > "
                             f"context_max_tokens ({self.context_max_tokens})")
        prev_t = 0.0
        for i, t in enumerate(self.arrivals_t):
            t = check_number(f"workload.arrivals_t[{i}]", t, strict=False)
            if t < prev_t:
                raise ValueError(f"workload.arrivals_t must be non-decreasing: [{i}] = {t} "
                                 f"after {prev_t}")
            prev_t = t
        for i, c in enumerate(self.arrivals_context_tokens):
            check_number(f"workload.arrivals_context_tokens[{i}]", c, minimum=1, strict=False)
        check_number("workload.trace_time_scale", self.trace_time_scale)
        if self.trace_path and self.kind != "trace":
            raise ValueError(f"workload.trace_path is set but workload.kind={self.kind!r}; "
                             "set workload.kind=trace")
        check_choice("workload.azure_trace", self.azure_trace, AZURE_TRACES)
        check_choice("workload.azure_arrivals", self.azure_arrivals, AZURE_ARRIVALS)
        if self.kind == "trace" and not self.trace_path and (
                not self.arrivals_t or len(self.arrivals_t) != len(self.arrivals_context_tokens)):
            raise ValueError("workload.kind=trace needs trace_path, or arrivals_t and "
                             "arrivals_context_tokens of equal, non-zero length")

    def max_output_tokens(self) -> int:
        """The most tokens any request decodes (a trace file's GeneratedTokens vary)."""
        if self.kind == "trace" and self.trace_path:
            from kvsim.scenario.request_trace import workload_trace

            return int(workload_trace(self).output_tokens.max())
        if self.kind == "azure":
            from kvsim.scenario.azure_workload import load_azure_shape

            return load_azure_shape(self.azure_trace).max_generated_tokens()
        return self.output_tokens


@dataclass
class SpeculativeConfig:
    cap_tokens: int = 64  # drafted tokens at most (the seeds' cap)
    acceptance: str = "seeds-fig10"  # geometric:<a> | seeds-fig10 | data/acceptance/<name>
    # extra seconds per drafted token (s, >= 0), or null (the default): from the codec
    # timing, a draft step dequantizes the request's anchor (its bf16-equivalent cache at
    # the codec's decode GB/s; kvsim.scenario.speculative.draft_overhead_s)
    draft_overhead_s: float | None = None
    # share (0..1) of the later streams' deserialization, run by the request's deserializer
    # on its decode instance while it drafts, during which a draft step makes no progress
    # (0: they overlap for free, as before; 1: the device runs the dequantization kernels
    # and the draft steps one after the other). deserializer=shared / per_stream only:
    # on_arrival has its measured draft_step.busy_ratio, on_demand dequantizes after drafting
    dequant_contention: float = 0.0

    def validate(self) -> None:
        if isinstance(self.cap_tokens, bool) or int(self.cap_tokens) != self.cap_tokens or \
                self.cap_tokens < 0:
            raise ValueError(f"speculative.cap_tokens must be an integer >= 0, "
                             f"got {self.cap_tokens!r}")
        if self.draft_overhead_s is not None:
            check_number("speculative.draft_overhead_s", self.draft_overhead_s, strict=False)
        if check_number("speculative.dequant_contention", self.dequant_contention,
                        strict=False) > 1.0:
            raise ValueError("speculative.dequant_contention must be <= 1, "
                             f"got {self.dequant_contention!r}")
        if not str(self.acceptance).strip():
            raise ValueError("speculative.acceptance must name an acceptance model")


@dataclass
class PrefixCacheConfig:
    """Prefix reuse (kvsim.scenario.prefix_cache): instances keep the KV blocks of the prompts
    they held, by the workload's prefix block ids (a trace's hash_ids), and a request reuses
    the leading blocks held. Off: no cache, today's results exactly."""

    enabled: bool = False  # keep and reuse prefix blocks (false: no cache, today's results)
    # tokens per block: the trace's (Mooncake's hash_ids name 512-token blocks); a request's
    # block ids must number ceil(context / block_tokens)
    block_tokens: int = 512
    # GB (1e9 bytes) of bf16 KV blocks each decode instance keeps; null: all its memory
    # beside the weights, shared with the running requests' caches (idle blocks are
    # evicted when an admission needs the room). A hit sends only the blocks it lacks
    decode_capacity_gb: float | None = None
    # the same on each prefill instance (its prefill skips the blocks held); 0: none
    prefill_capacity_gb: float | None = None
    eviction: str = "lru"  # least recently used idle block first, a prompt's tail first
    # a shared KV store (as Mooncake Store, LMCache's remote tier): GB (1e9 bytes) of bf16
    # blocks, written by every prefill as it ends; a decode instance fetches the blocks it
    # lacks that the store holds over the store's link, and is sent only the rest; 0: none
    store_capacity_gb: float = 0.0
    store_gbps: float = 100.0  # the store's link to the decode instances (one, shared)
    store_latency_s: float = 0.0  # added to every block fetched

    def validate(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"prefix_cache.enabled must be true or false, got "
                             f"{self.enabled!r}")
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or \
                self.block_tokens < 1:
            raise ValueError(f"prefix_cache.block_tokens must be an integer >= 1, got "
                             f"{self.block_tokens!r}")
        for key in ("decode_capacity_gb", "prefill_capacity_gb"):
            if getattr(self, key) is not None:
                check_number(f"prefix_cache.{key}", getattr(self, key), strict=False)
        check_number("prefix_cache.store_capacity_gb", self.store_capacity_gb, strict=False)
        check_number("prefix_cache.store_gbps", self.store_gbps)
        check_number("prefix_cache.store_latency_s", self.store_latency_s, strict=False)
        check_choice("prefix_cache.eviction", self.eviction, EVICTIONS)


STANDARD_KS = (1, 8, 16, 32, 64, 128)  # TTKT points reported by default (the seeds' k's)


@dataclass
class MetricsConfig:
    # TTKT points; empty: the standard ones the workload decodes (k <= output_tokens).
    # Listed k's must all be decoded (1 <= k <= output_tokens): none is dropped silently.
    ks: list[int] = field(default_factory=list)
    breakdown_k: int = 0  # TTKT whose critical path the breakdown splits; 0: min(32, tokens)

    def resolve(self, output_tokens: int) -> None:
        """Fill the automatic values (empty ks, breakdown_k 0), then check every k is a token
        the workload decodes: 1 <= k <= output_tokens."""
        if not self.ks:
            self.ks = [k for k in STANDARD_KS if k <= output_tokens] or [output_tokens]
        if self.breakdown_k == 0:
            self.breakdown_k = min(32, output_tokens)
        for key, values in (("metrics.ks", list(self.ks)), ("metrics.breakdown_k",
                                                            [self.breakdown_k])):
            for k in values:
                if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= output_tokens:
                    raise ValueError(f"{key}: {k!r} is not a token index in 1..{output_tokens} "
                                     f"(workload.output_tokens); drop it or raise "
                                     "workload.output_tokens")


@dataclass
class SimConfig:
    model: ModelSpec = MISSING
    hardware: HardwareSpec = MISSING
    link: LinkConfig = field(default_factory=LinkConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    # codec entries: preset names or {preset|name, params, label}; optional `transfer` key
    codecs: list[Any] = field(default_factory=lambda: ["bf16"])
    # auto (the best policy each codec supports) | seeds (the seeds' pairing) | a policy | a
    # list of them (kvsim.scenario.policy.TRANSFER_CHOICES)
    transfer: Any = "auto"
    granularity: str = "page"  # page: one message per (layer, page) | layer
    # shared: one deserializer per decode instance and request, streams in priority order
    # (anchor first) | per_stream: every stream its own deserializer (runs in parallel) |
    # node: one deserializer per decode instance shared by all its requests (FIFO by arrival) |
    # on_demand: nothing is dequantized on arrival; the decoder dequantizes the streams it
    # needs when they are all in (anchor, then the full cache once drafting stops), as
    # kvsim's transport receiver does with transport.dequantize=on_demand | on_arrival: one
    # worker per request dequantizes each layer once its last message is in (anchor layers
    # first, every policy pipelined), then the decoder builds its cache from them, as the
    # transport receiver does by default (and, as it does, on demand for a codec whose layers
    # do not decode alone: CacheGen; the row's `dequantize` says which mode ran)
    deserializer: str = "shared"
    # codec timing: a file path or a calibrated profile's name (kvsim calibrate); default
    # data/codec_timing/<hardware>.json
    codec_timing: str = ""
    # what estimated-size codecs (cachegen) measure their coded bytes on: file (the shipped
    # data/cachegen_ratio.json, SmolLM2 capture; error on other KV unknown) | synthetic (a
    # sample encode of synthetic KV of the model's shape) | a capture name or path
    size_calibration: str = "file"
    seed: int = 0
    samples: int = 1  # independent runs (seeds seed..seed+samples-1) averaged per row
    # rows whose times are drawn (drafts accepted by chance, random arrivals) average at least
    # this many runs: `kvsim sim`, `sweep` and `advise` raise a smaller `samples` to it and
    # say so (kvsim.scenario.samples; 1: one draw decides)
    min_samples: int = 8
    trace_path: str = ""  # write a Chrome-trace JSON event log of the runs here
    # write one row per request (every scenario and sample: phases, TTFT / TTKT drafted and
    # committed, bytes, drafts) here, as .parquet or .csv
    requests_path: str = ""
    title: str = ""  # what this scenario reproduces (printed above the table)
    # measured vNMSE tables (data/vnmse/<name>.json or paths), the first naming a codec wins:
    # the quality column of `kvsim sim` and advise's floor
    vnmse_tables: list[str] = field(
        default_factory=lambda: ["smollm2-135m-ctx1024", "smollm2-135m-ctx1024-lynx"])
    wide: bool = False  # print every time column (each k, from prefill end, the breakdown)
    # a measured hardware profile (hardware.profile=) on another host: probe this one and
    # rescale the profile's model times or refuse (kvsim.model.host)
    drift: DriftConfig = field(default_factory=DriftConfig)

    def validate(self) -> None:
        """Fill automatic values (metrics.ks empty, breakdown_k 0), then check every
        section's ranges (finite numbers, known choices); a ValueError names the key."""
        self.link.validate()
        self.workload.validate()
        self.speculative.validate()
        self.prefix_cache.validate()
        if self.workload.routing == "kv_aware" and not self.prefix_cache.enabled:
            raise ValueError("workload.routing=kv_aware routes by the prefix caches: set "
                             "prefix_cache.enabled=true")
        # ks up to the longest request; with a trace file's varying outputs, TTKT(k) is over
        # the requests that decode k tokens (rows count them: ttkt_requests)
        self.metrics.resolve(self.workload.max_output_tokens())
        self.hardware.validate()
        self.model.validate()
        check_choice("granularity", self.granularity, GRANULARITIES)
        check_choice("deserializer", self.deserializer, DESERIALIZERS)
        if self.workload.worker_slows_decode and self.deserializer != "on_arrival":
            raise ValueError(
                f"workload.worker_slows_decode slows the decode steps while a request's "
                f"on-arrival worker dequantizes its layers; deserializer={self.deserializer} "
                f"has no such worker: use deserializer=on_arrival")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or \
                self.samples < 1:
            raise ValueError(f"samples must be an integer >= 1, got {self.samples!r}")
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int) or \
                self.min_samples < 1:
            raise ValueError(f"min_samples must be an integer >= 1, got {self.min_samples!r}")
        if not self.codecs:
            raise ValueError("codecs must list at least one codec")
        from kvsim.kernels.presets import resolve_codec

        for entry in self.codecs:  # an unknown preset fails here, naming the closest one
            resolve_codec({k: v for k, v in entry.items() if k not in VARIANT_KEYS}
                          if isinstance(entry, dict) else entry)
        from kvsim.scenario.size_calibration import check_size_calibration

        if self.requests_path and not str(self.requests_path).endswith((".parquet", ".csv")):
            raise ValueError(f"requests_path must end in .parquet or .csv, got "
                             f"{self.requests_path!r}")
        check_size_calibration(self.size_calibration)
        if not self.vnmse_tables:
            raise ValueError("vnmse_tables must name at least one table (data/vnmse/)")
        from kvsim.scenario.variants import plan_variants

        plan_variants(self.codecs, self.transfer)  # an unknown transfer, or one no listed
        # codec can use, fails here
