"""How fast the sender's encoder runs beside its own transfer on a host that runs both ends.

`kvsim emulate` runs the sender and the decode host on the same cores. A pipelined transfer
(layer-wise, split-stream) sends each layer as it is encoded, so its encoder runs while the
receiver takes the bytes in and dequantizes them, and the faster the link the more of that
work lands beside it: on the 2-core host lynx's encoder (1024 and 2048 tokens) did 0.4-1.0x the
calibrated encode work at 0.1 Gbps and 1.4-2.2x at 1 Gbps over a `tc`-shaped veth, where the
kernel's shaping adds to the receiver's work (CHANGELOG.md, 2026-12-06). A monolithic
transfer encodes before its first byte leaves, beside nothing of its own.

The codec timing's encode rate (kvsim.scenario.codec_timing) is the calibration transfer's
at 0.3 Gbps over the token bucket. A link's `encoder_pace` is the median, over its
calibration transfers' pipelined requests at each of two rates, of the encoder's work
(the FIN's `encode_work_s`) over the codec timing's encode time of the same cache; the
simulator scales a pipelined request's encode times by it, interpolated linearly in the
link's rate between the two and held beyond them (encoder_ratio).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from kvsim.scenario.codec_timing import CodecTiming
from kvsim.scenario.link_profile import ENCODER_RATIO_MAX
from kvsim.scenario.policy import PIPELINED


def pace_entry(rows: list[dict], timing_of: Callable[[dict], CodecTiming],
               bf16_bytes: Callable[[int], float], model_name: str) -> dict | None:
    """A link profile's `encoder_pace` from its calibration transfers' request rows:
    {"rates_gbps": [r1, r2, ...], "ratio": [...], "requests": [...]} over the rates with
    pipelined requests that finished and timed their encoder; None with fewer than two such
    rates. timing_of(row): its codec's timing; bf16_bytes(tokens): a cache's bf16 size (B)."""
    by_rate: dict[float, list[float]] = {}
    for row in rows:
        work_s = row.get("encode_work_s")
        if row.get("status") != "done" or row.get("transfer") not in PIPELINED or \
                not isinstance(work_s, (int, float)) or not work_s > 0:
            continue
        base_s = timing_of(row).encode_s(bf16_bytes(int(row["context_tokens"])))
        by_rate.setdefault(float(row["bandwidth_gbps"]), []).append(float(work_s) / base_s)
    if len(by_rate) < 2:
        return None
    rates = sorted(by_rate)
    ratios = [statistics.median(by_rate[r]) for r in rates]
    if not all(0 < x <= ENCODER_RATIO_MAX for x in ratios):
        return None
    return {"rates_gbps": rates, "ratio": ratios, "requests": [len(by_rate[r]) for r in rates],
            "model": model_name,
            "measured": "the sender's encoder work (FIN encode_work_s) in the pipelined "
                        "requests of the calibration transfers over this link, over the codec "
                        "timing's encode time of the same cache: median per rate "
                        "(kvsim.calibrate.encoder_pace)"}
