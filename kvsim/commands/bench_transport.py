"""Real transport speed (kvsim/transport), every figure a ratio against a baseline measured in
the same run. Sender and receivers are separate processes (kvsim.bench.transport); the chunks
are real codec chunks of synthetic KV, encoded before the clock starts (encode=pre).

parts (run in this order; each adds rows):
  loopback      unshaped loopback: the transport (framing + CRC32C + credit window + ACKs)
                vs raw ZeroMQ (DEALER -> ROUTER, the same number of messages of the same
                sizes, zero-copy, no checksums, no acks), interleaved, best of `repeats`.
                Goodput = wire bytes / (last arrival - first send), GB/s (1e9 B/s); the
                transport's first send is its first_send_t (the link first holds the bytes).
  token_bucket  the transport through its token bucket at each rate: goodput / rate.
                The bucket starts empty when the first chunk is ready; goodput counts from
                the first chunk's send without that chunk (pay before send: it left after
                min(chunk, burst) / rate, every later chunk after chunk / rate).
  curve         the loopback comparison with CURVE on both (kvsim keys, made for the run in a
                temporary directory): the transport with CURVE vs raw ZeroMQ with CURVE
                (goodput ratio against the loopback target), and CURVE's own cost: raw
                ZeroMQ with CURVE vs without (the loopback part's raw run, where it ran).
  tc            (root + network namespaces; else rows say skipped and why) sender and
                receiver in two namespaces joined by a veth pair shaped by tc tbf at each
                rate, no application limit: the transport and raw ZeroMQ, goodput / rate.
  anchor        a split-stream codec (lynx) through the token bucket: time from the first
                send (first_send_t) until the anchor stream is complete vs ideal = anchor
                wire bytes * 8 / rate, once per `anchor.encode` mode (pre: encoded before;
                live: the codec runs in the sender's encoder thread while the link sends;
                rows give the encoder's seconds per layer beside the anchor's link time).
Every row also has CPU seconds per GB moved, sender and receiver process (process_time,
all threads); report=PATH rows add the sender's own pacing (send_gbps: chunks 2..N handed to
ZeroMQ), the receiver's page faults per MB, goodput_all_gbps (every chunk, from
first_send_t, as `kvsim emulate` rows count it), medians over repeats.
Each set of processes first moves a tiny request, and (loopback) one of the full size: a
fresh receiver page-faults in the memory of the largest request it has held (about 0.6 s/GB
of receiver CPU, once), which a long-running decode node has already paid; tc rows run in
fresh processes and include that cost.

knobs:
  parts             which parts run, e.g. 'parts=[loopback,token_bucket]'
  codec, policy     codec preset and transfer policy of loopback / token_bucket / tc
  shape.*           synthetic KV per layer: kv_heads, head_dim, tokens (with bf16 and 256-token
                    pages: 2*kv_heads*256*head_dim*2 bytes per chunk, 1 MiB by default)
  distinct_layers   layers generated and encoded; a cache of more layers repeats them
  seed              synthetic KV seed
  window_bytes, max_queued_bytes, timeout_s   the transport's settings (as transport.*)
  loopback.mb, loopback.repeats               MB per loopback transfer, repeats (best of)
  token_bucket.rates_gbps, .seconds, .burst_bytes   rates, ~seconds per point, bucket depth
  tc.rates_gbps, tc.seconds                   tbf rates, ~seconds per point (each point also
                                              runs raw ZeroMQ through the same link)
  anchor.codec, .policy, .rate_gbps, .anchor_seconds, .encode, .burst_bytes
  targets.*         the issue's targets (goodput GB/s and fraction of raw ZeroMQ unshaped,
                    fraction of the rate when shaped, anchor tolerance); rows say met or not
  session_timeout_s the longest one set of processes may run
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvsim.core.report import format_table

COMMAND = ("bench", "transport")
HELP = "real transport goodput vs raw ZeroMQ, token bucket and tc rates; anchor time; CPU/GB"
CONFIG_NAME = "bench_transport"
PARTS = ("loopback", "curve", "token_bucket", "tc", "anchor")
ENCODES = ("pre", "live")
# TCP payload per Ethernet frame on a 1500-byte MTU with timestamps: 1500 - 20 (IP) - 32 (TCP)
# = 1448 of 1514 bytes (tbf counts the 14-byte Ethernet header too)
TCP_PAYLOAD_FRACTION = 1448 / 1514


@dataclass
class ShapeConfig:
    kv_heads: int = 8
    head_dim: int = 128
    tokens: int = 4096  # per layer; chunks are (layer x 256-token page)


@dataclass
class LoopbackConfig:
    mb: float = 512.0  # MB (1e6 B) per transfer
    repeats: int = 5  # transport and raw ZeroMQ alternate; best of (median CPU)


@dataclass
class CurveConfig:
    mb: float = 256.0  # MB (1e6 B) per transfer (CURVE moves ~1 GB/s on 2 cores)
    repeats: int = 3  # transport and raw ZeroMQ alternate; best of (median CPU)


@dataclass
class TokenBucketConfig:
    rates_gbps: list[float] = field(default_factory=lambda: [0.1, 1.0, 5.0])
    seconds: float = 2.5  # bytes = rate * seconds (rounded to whole layers)
    burst_bytes: int = 0  # bucket depth (transport.burst_bytes); 0: 1 ms at the rate, >= 64 KiB


@dataclass
class TcConfig:
    rates_gbps: list[float] = field(default_factory=lambda: [0.1, 1.0])
    seconds: float = 2.5


@dataclass
class AnchorConfig:
    codec: str = "lynx"
    policy: str = "split_stream"
    rate_gbps: float = 1.0
    anchor_seconds: float = 1.0  # anchor bytes = rate * anchor_seconds (whole layers)
    encode: list[str] = field(default_factory=lambda: ["pre", "live"])
    burst_bytes: int = 0


@dataclass
class TargetsConfig:
    loopback_gb_per_s: float = 2.0
    loopback_vs_raw: float = 0.75
    rate_fraction: float = 0.97
    anchor_tolerance: float = 0.05  # |measured / ideal - 1|


@dataclass
class Config:
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    codec: str = "bf16"
    policy: str = "monolithic"
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    distinct_layers: int = 2
    seed: int = 0
    window_bytes: int = 16777216
    max_queued_bytes: int = 268435456
    timeout_s: float = 30.0
    session_timeout_s: float = 600.0
    loopback: LoopbackConfig = field(default_factory=LoopbackConfig)
    curve: CurveConfig = field(default_factory=CurveConfig)
    token_bucket: TokenBucketConfig = field(default_factory=TokenBucketConfig)
    tc: TcConfig = field(default_factory=TcConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    targets: TargetsConfig = field(default_factory=TargetsConfig)

    def validate(self) -> None:
        from kvsim.kernels.presets import resolve_codec
        from kvsim.scenario.policy import POLICIES

        bad = [p for p in self.parts if p not in PARTS]
        if bad or not self.parts:
            raise ValueError(f"parts must be a non-empty list of {PARTS}, got {self.parts}")
        for key, value in (("policy", self.policy), ("anchor.policy", self.anchor.policy)):
            if value not in POLICIES:
                raise ValueError(f"{key} must be one of {POLICIES}, got {value!r}")
        resolve_codec(self.codec)
        resolve_codec(self.anchor.codec)
        if not set(self.anchor.encode) <= set(ENCODES) or not self.anchor.encode:
            raise ValueError(f"anchor.encode must be a list of {ENCODES}, got "
                             f"{self.anchor.encode}")
        positive = {"loopback.mb": self.loopback.mb, "loopback.repeats": self.loopback.repeats,
                    "curve.mb": self.curve.mb, "curve.repeats": self.curve.repeats,
                    "token_bucket.seconds": self.token_bucket.seconds,
                    "tc.seconds": self.tc.seconds, "anchor.rate_gbps": self.anchor.rate_gbps,
                    "anchor.anchor_seconds": self.anchor.anchor_seconds,
                    "distinct_layers": self.distinct_layers, "timeout_s": self.timeout_s,
                    "window_bytes": self.window_bytes, "max_queued_bytes": self.max_queued_bytes,
                    "session_timeout_s": self.session_timeout_s,
                    "shape.kv_heads": self.shape.kv_heads,
                    "shape.head_dim": self.shape.head_dim, "shape.tokens": self.shape.tokens,
                    **{f"rate {r}": r for r in [*self.token_bucket.rates_gbps,
                                                *self.tc.rates_gbps]}}
        for key, value in positive.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be > 0, got {value!r}")
        for key, value in (("token_bucket.burst_bytes", self.token_bucket.burst_bytes),
                           ("anchor.burst_bytes", self.anchor.burst_bytes)):
            if value < 0:
                raise ValueError(f"{key} must be >= 0 (0: the transport's default), "
                                 f"got {value}")


def run(cfg: Config) -> list[dict]:
    from kvsim.bench import transport as bt

    cfg.validate()
    rows = bt.run_bench(cfg)
    main = [r for r in rows if r["part"] != "anchor"]
    if main:
        print(format_table(main, [
            ("part", "part", ""), ("case", "case", ""), ("rate_gbps", "rate Gbps", "g"),
            ("mb", "MB", ".0f"), ("chunks", "chunks", "d"),
            ("goodput_gb_per_s", "goodput GB/s", ".3f"), ("goodput_gbps", "Gbps", ".3f"),
            ("baseline", "vs", ""), ("ratio", "ratio", ".3f"), ("target", "target", ""),
            ("met", "met", ""), ("tx_cpu_s_per_gb", "tx CPU s/GB", ".2f"),
            ("rx_cpu_s_per_gb", "rx CPU s/GB", ".2f")]))
    anchor = [r for r in rows if r["part"] == "anchor"]
    if anchor:
        print()
        print(format_table(anchor, [
            ("part", "part", ""), ("case", "case", ""), ("rate_gbps", "rate Gbps", "g"),
            ("anchor_mb", "anchor MB", ".1f"), ("anchor_chunks", "chunks", "d"),
            ("anchor_s", "anchor s", ".4f"), ("ideal_s", "ideal s", ".4f"),
            ("ratio", "ratio", ".4f"), ("target", "target", ""), ("met", "met", ""),
            ("all_streams_s", "all streams s", ".3f"),
            ("encode_per_layer_s", "encode s/layer", ".4f"),
            ("anchor_link_per_layer_s", "anchor link s/layer", ".4f"),
            ("tx_cpu_s_per_gb", "tx CPU s/GB", ".2f"),
            ("rx_cpu_s_per_gb", "rx CPU s/GB", ".2f")]))
    for r in rows:
        if r.get("status") != "done":
            print(f"{r['part']} {r['case']}: {r['status']}: {r.get('reason', '')}")
    print("goodput = wire bytes (44-byte frame headers + payload) / (last arrival - first "
          "send); ratios against the baseline named in `vs`, measured in this run")
    curve = next((r for r in rows if r["part"] == "curve" and r["case"] == "raw_zmq"
                  and "vs_plain_raw_zmq" in r), None)
    if curve:
        print(f"curve: CURVE's own cost: raw ZeroMQ with CURVE moves "
              f"{curve['vs_plain_raw_zmq']:.3f}x the bytes per second of raw ZeroMQ without "
              "it (loopback part), at the CPU s/GB above")
    tc = [r for r in rows if r["part"] == "tc" and "vs_raw_zmq" in r]
    if tc:
        print("tc: transport / raw ZeroMQ through the same link: " + ", ".join(
            f"{r['vs_raw_zmq']:.3f} at {r['rate_gbps']:g} Gbps" for r in tc) +
            "; tbf meters whole frames, so TCP over a 1500-byte MTU carries at most "
            f"{TCP_PAYLOAD_FRACTION:.3f} of its rate (1448 payload bytes per 1514-byte frame)")
    return rows
