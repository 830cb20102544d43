"""Typed configuration of `kvsim sim` / `kvsim bench sim` (Hydra ConfigStore schemas).

Groups: conf/model/*.yaml -> ModelSpec, conf/hardware/*.yaml -> HardwareSpec,
conf/link/*.yaml -> LinkConfig, conf/workload/*.yaml -> WorkloadConfig,
conf/scenario/*.yaml (`# @package _global_` experiment files, also reachable as scenarios/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from kvsim.hardware import HardwareSpec
from kvsim.models import ModelSpec

SHARINGS = ("per_prefill", "shared")
SCHEDULINGS = ("anchors_first", "fifo")
WORKLOAD_KINDS = ("single", "poisson", "trace")
CONTEXT_DISTS = ("fixed", "uniform", "lognormal")


@dataclass
class LinkConfig:
    name: str = "link"
    bandwidth_gbps: float = 10.0  # 1e9 bit/s
    latency_s: float = 0.0  # propagation, added to every message
    message_overhead_bytes: float = 0.0  # framing bytes per message on top of its payload
    trace: list[list[float]] = field(default_factory=list)  # [[t_s, gbps], ...] steps
    sharing: str = "per_prefill"  # per_prefill: one egress link per prefill node | shared
    scheduling: str = "anchors_first"  # anchors_first: class = stream | fifo: by request

    def validate(self) -> None:
        if self.sharing not in SHARINGS:
            raise ValueError(f"link.sharing must be one of {SHARINGS}, got {self.sharing!r}")
        if self.scheduling not in SCHEDULINGS:
            raise ValueError(f"link.scheduling must be one of {SCHEDULINGS}, "
                             f"got {self.scheduling!r}")
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"link.bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")


@dataclass
class WorkloadConfig:
    name: str = "single"
    kind: str = "single"  # single | poisson | trace
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
    prefill_nodes: int = 1
    decode_nodes: int = 1
    decode_max_batch: int = 64  # concurrent sequences per decode instance

    def validate(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload.kind must be one of {WORKLOAD_KINDS}, got {self.kind!r}")
        if self.context_dist not in CONTEXT_DISTS:
            raise ValueError(f"workload.context_dist must be one of {CONTEXT_DISTS}")
        for key in ("context_tokens", "output_tokens", "requests", "prefill_nodes",
                    "decode_nodes", "decode_max_batch", "context_round_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"workload.{key} must be >= 1, got {getattr(self, key)}")
        if self.kind == "trace" and (not self.arrivals_t or len(self.arrivals_t) != len(
                self.arrivals_context_tokens)):
            raise ValueError("workload.kind=trace needs arrivals_t and arrivals_context_tokens "
                             "of equal, non-zero length")


@dataclass
class SpeculativeConfig:
    cap_tokens: int = 64  # drafted tokens at most (the seeds' cap)
    acceptance: str = "seeds-fig10"  # geometric:<a> | seeds-fig10 | data/acceptance/<name>
    draft_overhead_s: float = 0.0  # extra per drafted token (dequantized-anchor overhead)


@dataclass
class MetricsConfig:
    ks: list[int] = field(default_factory=lambda: [1, 8, 16, 32, 64, 128])
    breakdown_k: int = 32  # TTKT whose critical path the breakdown splits


@dataclass
class SweepConfig:
    """Lists to run the product of (empty: use the single value from link / workload)."""

    context_tokens: list[int] = field(default_factory=list)
    bandwidth_gbps: list[float] = field(default_factory=list)


@dataclass
class SimConfig:
    model: ModelSpec = MISSING
    hardware: HardwareSpec = MISSING
    link: LinkConfig = field(default_factory=LinkConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    # codec entries: preset names or {preset|name, params, label}; optional `transfer` key
    codecs: list[Any] = field(default_factory=lambda: ["bf16"])
    transfer: Any = "auto"  # auto (codec's natural policy) | policy | list of policies
    granularity: str = "page"  # page: one message per (layer, page) | layer
    codec_timing: str = ""  # path of a codec timing file (default data/codec_timing/<hw>.json)
    seed: int = 0
    samples: int = 1  # independent runs (seeds seed..seed+samples-1) averaged per row
    trace_path: str = ""  # write a Chrome-trace JSON event log of the runs here
    title: str = ""  # what this scenario reproduces (printed above the table)
