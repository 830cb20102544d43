"""Typed configuration of the real transport (`kvsim serve` / `kvsim send` / `kvsim emulate`):
a scenario exactly as `kvsim sim` reads it, plus a `transport` section."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim.core.checks import check_choice, check_number
from kvsim.core.wakeup_latency import LEAVE, MAX_US
from kvsim.scenario.config import SimConfig

EMULATIONS = ("token_bucket", "tc", "none")
KV_SOURCES = ("auto", "live", "capture", "synthetic")
DECODES = ("auto", "real", "timing")
DEQUANTIZE_MODES = ("on_arrival", "on_demand")  # the receiver's (kvsim.transport.assembly)


@dataclass
class TransportConfig:
    # token_bucket: application-level rate limit (link.bandwidth_gbps) over loopback |
    # tc: two network namespaces joined by a veth pair shaped by tc (needs root) |
    # none: unshaped (as fast as the machine moves bytes)
    emulation: str = "token_bucket"
    bind: str = "tcp://127.0.0.1:5557"  # kvsim serve: where the decode node listens
    connect: str = "tcp://127.0.0.1:5557"  # kvsim send: the decode node's address
    port: int = 0  # kvsim emulate: TCP port (0: a free one)
    burst_bytes: int = 0  # token bucket lead: a chunk may leave this many bytes' time early
    delay_ms: float = 0.0  # tc netem one-way delay
    jitter_ms: float = 0.0  # tc netem delay jitter
    loss_pct: float = 0.0  # tc netem loss (TCP retransmits what is lost)
    timeout_s: float = 30.0  # a peer silent this long is declared lost
    heartbeat_s: float = 0.5  # idle peers say they are alive this often
    window_bytes: int = 16777216  # credit: unprocessed bytes a sender may have in flight
    # over tc the sender keeps at most link rate x in_flight_ms unacknowledged: what is in
    # the shaper's queue is past the scheduler (0: window_bytes; the token bucket keeps
    # window_bytes: kvsim.transport.session.max_in_flight_bytes)
    in_flight_ms: float = 10.0
    max_queued_bytes: int = 268435456  # encoded chunks waiting for the link (backpressure)
    max_request_bytes: int = 8589934592  # kvsim serve refuses larger (bf16) caches
    max_active_requests: int = 64  # kvsim serve refuses a request beyond this many at once
    max_requests_per_peer: int = 16  # ... and beyond this many from one peer
    # kvsim serve: every request's held chunks and dequantized cache are reserved against
    # this at admission ("busy: memory" beyond it); 0: half of this host's physical memory
    max_memory_bytes: int = 0
    # kvsim serve with device=cuda: the device memory its requests' dequantized caches (then
    # on the device, not in max_memory_bytes) are reserved against ("busy: device memory"
    # beyond it); 0: the device's free memory once the model is loaded and warmed up, less
    # 10% (kvsim.transport.receiver.DEVICE_MEMORY_HEADROOM)
    max_device_memory_bytes: int = 0
    # kvsim serve: a request still running this long after its HELLO is ended and freed
    # (wall-clock s, whatever its time_scale)
    request_deadline_s: float = 3600.0
    # CURVE authentication and encryption (ZeroMQ's own): a directory written by `kvsim keys`
    # (server.key_secret + allowed/*.key for kvsim serve; client.key_secret + server.key
    # for kvsim send; kvsim emulate uses both). "": no keys, plain TCP, only on loopback
    # unless insecure=true
    keys: str = ""
    insecure: bool = False  # allow a non-loopback bind / connect without keys (warned)
    # Prometheus metrics of kvsim serve / send / emulate's sender on this port (0: none),
    # on metrics_addr
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    # auto: live if the model preset's weights are here (model.path, fetched, random_init),
    # else synthetic
    kv_source: str = "auto"
    capture: str = ""  # kv_source=capture: a capture name or path
    decode: str = "auto"  # auto: real if the model's weights are here, else timing
    text_source: str = "stdlib-docs"  # the real text a live prefill reads (kvsim.kv.text)
    # a live prefill of a prompt this process prefilled before (same model, same tokens)
    # reuses that prefill's KV, first token and measured time, booked without being waited:
    # the request's arrival and prefill start move back by it (kvsim.transport.source).
    # One request at a time only (workload.kind=single): a validation's repeats
    reuse_prefill: bool = False
    threads: int = 1  # torch threads per process (sender and receiver share the cores)
    # kvsim emulate: the sender on the first half of this process's CPUs, the decode host on
    # the rest, as a disaggregated deployment gives each side its own (kvsim.transport.cpus)
    split_cpus: bool = False
    cpus: str = ""  # kvsim serve / send: pin this process to these CPUs ("1", "0-3,6"; "": all)
    # kvsim serve / send: hold every CPU of the host to wake within this many us while they
    # run (Linux PM QoS, root; kvsim.core.wakeup_latency): a decode step after an idle wait
    # otherwise runs slower. -1: leave the host's idle states as they are
    cpu_wakeup_us: int = 0
    max_requests: int = 0  # kvsim serve: exit after this many requests (0: until Ctrl-C)
    idle_exit_s: float = 0.0  # kvsim serve: exit after this long with nothing to do (0: never)
    endpoint_file: str = ""  # kvsim serve: write the bound endpoint here (for scripts)
    # k > 1: the link runs k times slower and every modelled time (prefill of synthetic or
    # captured KV, timing-model decode steps) k times longer; rows divide durations by k.
    # For links faster than this machine can carry. Timing-model decode only; real work
    # (encode, dequantize, framing) is not slowed, so it shrinks k-fold in the row.
    time_scale: float = 1.0
    start_timeout_s: float = 300.0  # kvsim emulate: the decode host loads + warms up by then
    # kvsim serve: on_arrival: a worker per request dequantizes each layer once its chunks
    # are in (kvsim sim's deserializer=on_arrival) | on_demand: the decoder dequantizes the
    # whole cache when it starts on it (deserializer=on_demand)
    dequantize: str = "on_arrival"

    def validate(self) -> None:
        for key, allowed in (("emulation", EMULATIONS), ("kv_source", KV_SOURCES),
                             ("decode", DECODES), ("dequantize", DEQUANTIZE_MODES)):
            check_choice(f"transport.{key}", getattr(self, key), allowed)
        for key in ("timeout_s", "heartbeat_s", "start_timeout_s"):
            check_number(f"transport.{key}", getattr(self, key))
        for key in ("delay_ms", "jitter_ms", "idle_exit_s", "in_flight_ms"):
            check_number(f"transport.{key}", getattr(self, key), strict=False)
        if check_number("transport.loss_pct", self.loss_pct, strict=False) > 100:
            raise ValueError(f"transport.loss_pct must be <= 100, got {self.loss_pct}")
        if self.burst_bytes < 0:
            raise ValueError(f"transport.burst_bytes must be >= 0, got {self.burst_bytes}")
        for key in ("window_bytes", "max_queued_bytes", "max_request_bytes", "max_active_requests",
                    "max_requests_per_peer", "threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"transport.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("port", "metrics_port"):
            if not 0 <= getattr(self, key) < 65536:
                raise ValueError(f"transport.{key} must be in 0..65535, got {getattr(self, key)}")
        if not LEAVE <= self.cpu_wakeup_us <= MAX_US:
            raise ValueError(f"transport.cpu_wakeup_us must be 0..{MAX_US} (us), or {LEAVE} to "
                             f"leave the host's idle states, got {self.cpu_wakeup_us}")
        from kvsim.transport.cpus import parse_cpus

        parse_cpus(self.cpus)  # a malformed list fails here, before anything starts
        if self.max_device_memory_bytes < 0:
            raise ValueError(f"transport.max_device_memory_bytes must be >= 0 (0: the "
                             f"device's free memory), got {self.max_device_memory_bytes}")
        if self.max_memory_bytes < 0:
            raise ValueError(f"transport.max_memory_bytes must be >= 0 (0: half of this host's "
                             f"memory), got {self.max_memory_bytes}")
        check_number("transport.request_deadline_s", self.request_deadline_s)
        if check_number("transport.time_scale", self.time_scale) < 1:
            raise ValueError(f"transport.time_scale must be >= 1, got {self.time_scale}")
        if self.time_scale != 1 and (self.decode == "real" or self.kv_source == "live"):
            raise ValueError("transport.time_scale != 1 needs transport.decode=timing and a "
                             "modelled prefill (kv_source synthetic or capture): real model "
                             "times cannot be slowed down")
        if self.kv_source == "capture" and not self.capture:
            raise ValueError("transport.kv_source=capture needs transport.capture=NAME|PATH")


@dataclass
class EmulateConfig(SimConfig):
    transport: TransportConfig = field(default_factory=TransportConfig)
    # kvsim send: resume the requests of an earlier run that the decode host still holds,
    # sending only what it lacks: that run's report (report=PATH of kvsim send) or one
    # request id (32 hex digits)
    resume: str = ""
    # where the KV cache lives and the real model runs: cpu | cuda | cuda:N | auto (cuda
    # where torch sees one). On a CUDA device the sender prefills there (a live source; a
    # synthetic or captured cache is moved there before its encode) and encodes there (the
    # codecs' device paths where they have one, kvsim.kernels.device_wire), and the decode
    # host dequantizes into that device's memory and decodes there
    device: str = "cpu"

    def _check_instances(self) -> None:
        """The workload's instances as the transport runs them (prefill: PrefillInstances,
        decode: DecodeInstances), or a refusal where it cannot run them as the simulator
        does."""
        w = self.workload
        if w.prefill_nodes > 1 and self.link.sharing != "shared":
            raise ValueError(
                f"the transport sends over one link: workload.prefill_nodes="
                f"{w.prefill_nodes} needs link.sharing=shared (with per_prefill the "
                f"simulator gives each prefill instance a link of its own)")
        if w.routing == "kv_aware" and (w.prefill_nodes > 1 or w.decode_nodes > 1):
            raise ValueError(
                "workload.routing=kv_aware reads the simulator's per-instance prefix caches, "
                "which the transport does not keep: use least_loaded or round_robin, or one "
                "prefill and one decode instance")
        if w.prefill_chunk_tokens:
            raise ValueError(
                f"workload.prefill_chunk_tokens={w.prefill_chunk_tokens}: the transport's "
                f"prefill instances prefill one whole prompt at a time (chunked prefill "
                f"batching is the simulator's, kvsim.sim.prefill_batch): set it to 0")
        if w.colocated_prefill:
            raise ValueError(
                "workload.colocated_prefill tells the simulator that prefill and decode share "
                "a host; the emulator's hosts are what they are (on one machine they share "
                "it): set it false here")
        if w.worker_slows_decode:
            raise ValueError(
                "workload.worker_slows_decode tells the simulator that the decode instance's "
                "on-arrival workers share its processor; the emulator's receiver runs them "
                "where it runs them (in its own process): set it false here")

    def validate(self) -> None:
        super().validate()
        self.transport.validate()
        from kvsim.core.device import check_device_name

        check_device_name(self.device)
        if self.transport.reuse_prefill and self.workload.kind != "single":
            raise ValueError(f"transport.reuse_prefill books a reused prefill's time without "
                             f"waiting it, which only a lone request can (workload.kind="
                             f"single), not workload.kind={self.workload.kind}")
        self._check_instances()
        pc = self.prefix_cache
        if pc.enabled:  # the decode node's prefix store (kvsim.transport.prefix_store)
            if self.transport.decode != "timing" or self.transport.kv_source == "live":
                raise ValueError(
                    "prefix_cache.enabled in the transport reuses an earlier request's chunks "
                    "for a prompt's held blocks, which a real model would read as another "
                    "prompt's: set transport.decode=timing (and kv_source synthetic or "
                    "capture)")
            if pc.prefill_capacity_gb != 0 or pc.store_capacity_gb:
                raise ValueError(
                    "the transport emulates the decode side's reuse only: set "
                    "prefix_cache.prefill_capacity_gb=0 and prefix_cache.store_capacity_gb=0 "
                    "(the simulator models prefill-side caches and a shared store)")
            from kvsim.scenario.variants import variants

            for v in variants(self):
                codec = v.spec.build()
                page = codec.page_tokens(self.model.kv_shape(pc.block_tokens))
                if not codec.pages_encode_alone() or pc.block_tokens % page:
                    raise ValueError(
                        f"prefix reuse in the transport needs whole pages per block of a codec "
                        f"whose pages encode alone (Codec.pages_encode_alone: bf16, int8/int4 "
                        f"per group, lynx); {v.spec.label} with {page}-token pages and "
                        f"prefix_cache.block_tokens={pc.block_tokens} is not")
        if pc.enabled and self.workload.decode_nodes > 1:
            raise ValueError(
                f"the transport's decode host keeps one prefix store for all its instances, "
                f"the simulator one per instance: prefix_cache.enabled needs "
                f"workload.decode_nodes=1 here, got {self.workload.decode_nodes}")
        if self.speculative.dequant_contention:
            raise ValueError("speculative.dequant_contention is the simulator's model of a "
                             "device that dequantizes while it drafts; the transport's "
                             "receiver does both for real (its on-arrival worker beside the "
                             "drafts): leave it 0 here")
