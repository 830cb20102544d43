"""Transfer policies: which bytes go as which flows, when they may leave, when decoding starts.

- monolithic: encode the whole cache after prefill, then send it (all streams in chunk
  order, one flow), then deserialize all of it; decode starts after that.
- layerwise: each layer is encoded as soon as prefill produced it and sent (one flow,
  pipelined: chunk i on the wire while i+1 is encoded); each chunk is deserialized on
  arrival; decode still needs every layer.
- split_stream: one flow per stream, strict priority stream 0 (anchor) > stream 1 > ...;
  encoding starts after prefill (as the seeds' prototype: the connector takes the cache
  after prefill) and is pipelined with sending; decode starts (speculatively) when stream 0
  of every layer is deserialized, verification when every stream is.
- split_stream_layerwise: split_stream whose encoding follows prefill layer by layer.

Chunks are (layer, page) in layer-major order; with granularity `layer` the pages of a
layer travel as one message (coarser, far fewer events: for big multi-request runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.core.layout import KVShape
from kvsim.kernels.encoded import SizeTable
from kvsim.scenario.codec_timing import CodecTiming

POLICIES = ("monolithic", "layerwise", "split_stream", "split_stream_layerwise")
PIPELINED = ("layerwise", "split_stream", "split_stream_layerwise")  # chunks leave as encoded
WITH_PREFILL = ("layerwise", "split_stream_layerwise")  # encoding follows prefill layer by layer
GRANULARITIES = ("page", "layer")


@dataclass
class FlowPlan:
    stream: int  # priority class inside the request (0 = anchor, or the merged flow)
    name: str
    sizes_bytes: np.ndarray  # [m] wire bytes of each message
    chunk: np.ndarray  # [m] index of the chunk whose encoding releases the message
    deserialize_s: np.ndarray  # [m] deserialize + dequantize time of each message


@dataclass
class TransferPlan:
    policy: str
    flows: list[FlowPlan]
    chunk_layer: np.ndarray  # [c] layer of each chunk (layer-major)
    encode_s: np.ndarray  # [c] encode time of each chunk (all its streams at once)
    stream_names: list[str]
    stream_bytes: list[int]  # wire bytes per stream (preamble counted in stream 0)
    total_bytes: int
    encode_cum_s: np.ndarray = field(init=False)  # [c] s, encode time through chunk i

    def __post_init__(self) -> None:
        self.encode_cum_s = np.cumsum(self.encode_s)

    @property
    def speculative(self) -> bool:
        return self.policy.startswith("split_stream") and len(self.flows) > 1

    @property
    def pipelined_with_prefill(self) -> bool:
        return self.policy in WITH_PREFILL

    @property
    def pipelined(self) -> bool:
        return self.policy in PIPELINED


# what `transfer` may say: a policy, or a rule choosing one per codec
#   auto: the best policy the codec supports (layer-wise encoding pipelined with prefill where
#         its layers encode alone; split into streams when it has several):
#         layerwise | split_stream_layerwise (a codec that encodes whole: monolithic)
#   seeds: the seeds' pairing in their Table 1 and Figure 11: a one-stream codec's cache sent
#         whole after prefill (monolithic), a several-stream codec's as split_stream
TRANSFER_RULES = ("auto", "seeds")
TRANSFER_CHOICES = TRANSFER_RULES + POLICIES


def chosen_policy(transfer: str, num_streams: int, layer_independent: bool = True) -> str:
    """The policy `transfer` (a TRANSFER_CHOICES entry) gives a codec of num_streams. auto
    encodes layer by layer only a codec whose layers encode alone (CacheGen's bits per layer
    depend on the whole cache: the transport encodes it whole, so it goes monolithic)."""
    several = num_streams > 1
    if transfer == "auto":
        if not layer_independent:
            return "split_stream" if several else "monolithic"
        return "split_stream_layerwise" if several else "layerwise"
    if transfer == "seeds":
        return "split_stream" if several else "monolithic"
    return transfer


def applicable(policy: str, num_streams: int) -> bool:
    """Whether a codec of num_streams can use the policy: splitting needs several streams (a
    one-stream codec under a split-stream policy would be layerwise or monolithic renamed)."""
    return num_streams > 1 or not policy.startswith("split_stream")


def build_plan(table: SizeTable, shape: KVShape, policy: str, timing: CodecTiming,
               devices: int = 1, granularity: str = "page", layer_jobs: bool = False,
               anchor_jobs: bool = False) -> TransferPlan:
    """The request's flows and per-message work.

    Deserialization work per message: by default each chunk's dequantization split between
    its streams by their bytes. layer_jobs (deserializer=on_arrival, the transport
    receiver's worker): a layer is dequantized when its last message arrives: the message
    completing layer l of the last stream carries the layer's full dequantization and, with
    anchor_jobs (the decoder drafts on the anchor), the one completing layer l of stream 0
    carries the anchor's alone; every other message carries none. A job costs the codec
    timing's layer_job_s (a fixed part + its bytes where calibrated, else its bytes)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown transfer policy {policy!r}; choose from {POLICIES}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose from {GRANULARITIES}")
    by_chunk = table.chunk_bytes.astype(np.float64)  # [streams, layers, pages]
    streams, layers, pages = by_chunk.shape
    pt = table.page_tokens
    page_tok = np.full(pages, pt, dtype=np.float64)
    page_tok[-1] = shape.tokens - pt * (pages - 1)
    # bf16 bytes of each (layer, page) chunk: K and V, kv_heads x tokens x head_dim x 2 B
    bf16 = np.broadcast_to(page_tok * (2 * shape.kv_heads * shape.head_dim * 2),
                           (layers, pages))
    if granularity == "layer":
        by_chunk = by_chunk.sum(axis=2, keepdims=True)
        bf16 = bf16.sum(axis=1, keepdims=True)
    per_chunk = by_chunk.reshape(streams, -1)  # [streams, c], layer-major
    bf16 = np.ascontiguousarray(bf16).reshape(-1)  # [c]
    n_chunks = per_chunk.shape[1]
    chunk_layer = np.repeat(np.arange(layers), n_chunks // layers)
    encode_s = bf16 / (timing.encode_gb_per_s * 1e9 * devices)
    decode_full = bf16 / (timing.decode_gb_per_s * 1e9 * devices)  # [c]
    totals = per_chunk.sum(axis=0)
    share = np.divide(per_chunk, totals, out=np.zeros_like(per_chunk), where=totals > 0)
    deser = share * decode_full  # [streams, c]: a stream's share of the chunk's decode work

    if layer_jobs:
        deser = _layer_job_work(per_chunk, chunk_layer, bf16, timing, devices,
                                anchor_jobs and policy.startswith("split_stream"))
    flows: list[FlowPlan] = []
    if policy.startswith("split_stream") and streams > 1:
        for s in range(streams):
            mask = per_chunk[s] > 0
            idx = np.nonzero(mask)[0]
            if len(idx) == 0:
                raise ValueError(f"stream {s} ({table.stream_names[s]}) has no bytes")
            flows.append(FlowPlan(s, table.stream_names[s], per_chunk[s, idx].copy(), idx,
                                  deser[s, idx].copy()))
    else:
        # one flow, messages in (chunk, stream) order
        order_chunk = np.repeat(np.arange(n_chunks), streams)
        flat = per_chunk.T.reshape(-1)
        flat_deser = deser.T.reshape(-1)
        mask = flat > 0
        flows.append(FlowPlan(0, "+".join(table.stream_names), flat[mask].copy(),
                              order_chunk[mask], flat_deser[mask].copy()))
    flows[0].sizes_bytes[0] += table.header_bytes  # preamble rides with the first message
    stream_bytes = [int(x) for x in table.chunk_bytes.sum(axis=(1, 2))]
    stream_bytes[0] += table.header_bytes
    return TransferPlan(policy, flows, chunk_layer, encode_s, list(table.stream_names),
                        stream_bytes, int(table.total_bytes))


def _layer_job_work(per_chunk: np.ndarray, chunk_layer: np.ndarray, bf16: np.ndarray,
                    timing: CodecTiming, devices: int, anchor: bool) -> np.ndarray:
    """[streams, c] work (s) of deserializer=on_arrival: on the last chunk of each layer
    that has bytes in a stream, that layer's full dequantization (last stream) or the
    anchor's (stream 0, when drafted on); zero elsewhere. In a single merged flow
    (messages in (chunk, stream) order) the last stream's last chunk of a layer is the
    layer's last message, so the same array serves both layouts."""
    streams, n_chunks = per_chunk.shape
    layers = int(chunk_layer[-1]) + 1
    layer_bf16 = np.bincount(chunk_layer, weights=bf16, minlength=layers)  # [layers]
    work = np.zeros((streams, n_chunks))
    targets = [(streams - 1, False)]
    if anchor and streams > 1:
        targets.append((0, True))
    for s, anchor_job in targets:
        has = np.nonzero(per_chunk[s] > 0)[0]
        if len(has) == 0:
            continue
        # last chunk with bytes of each layer: where the layer index changes, and the end
        last = has[np.append(chunk_layer[has][1:] != chunk_layer[has][:-1], True)]
        work[s, last] = timing.layer_job_s(layer_bf16[chunk_layer[last]], devices,
                                           anchor_job)  # [layers] s
    return work


def release_times(plan: TransferPlan, prefill_start_t: float, prefill_s: float, layers: int,
                  encoder_free_t: float) -> np.ndarray:
    """[c] time each chunk's encoding finishes (its messages are released then).

    The encoder is one serial pipeline per prefill instance: chunk i starts encoding at
    max(ready_i, end of chunk i-1). ready_i = the end of its layer's prefill (pipelined with
    prefill) or the end of prefill; monolithic releases everything when the last chunk is
    encoded."""
    prefill_end = prefill_start_t + prefill_s
    if plan.pipelined_with_prefill:
        ready = prefill_start_t + (plan.chunk_layer + 1) * (prefill_s / layers)
        ready[-1] = prefill_end
        done = serial_pipeline(np.maximum(ready, encoder_free_t), plan.encode_s)
    else:
        # every chunk ready at once: serial_pipeline's closed form is then the start plus
        # the running sum of the encode times (the same floats, without the scan)
        done = plan.encode_cum_s + max(prefill_end, encoder_free_t)
    if not plan.pipelined:
        done = np.full_like(done, done[-1])
    return done


def serial_pipeline(ready_t: np.ndarray, work_s: np.ndarray, free_t: float = -np.inf,
                    ) -> np.ndarray:
    """Finish times of jobs through one FIFO server: f_i = max(f_{i-1}, ready_i) + work_i.

    Closed form: f_i = W_i + max(free_t, max_{j<=i}(ready_j - W_{j-1})), W = prefix sums."""
    w = np.cumsum(work_s)
    w_prev = w - work_s
    start = np.maximum.accumulate(np.asarray(ready_t, dtype=np.float64) - w_prev)
    return w + np.maximum(start, free_t)
