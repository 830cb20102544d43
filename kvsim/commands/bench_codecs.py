"""Every codec on the same KV cache: serialized bits per element, per-stream bytes, KV relative
MSE, attention-output vNMSE (full, anchor-only and per stream prefix), encode / decode GB/s
(bf16-equivalent input bytes / median seconds) and their ratio to a torch clone of the same
tensor timed in the same run. KV: synthetic (kvsim.kv.synthetic) or a capture (kv_source=NAME)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from kvsim.bench.codecs import (
    bench_codec,
    capture_source,
    copy_baseline_s,
    synthetic_source,
)
from kvsim.bench.coder_split import coder_split
from kvsim.bench.device_codecs import device_timing
from kvsim.core.device import resolve_device
from kvsim.core.layout import KVShape
from kvsim.core.outputs import check_new, out_root
from kvsim.core.paths import DATA_DIR
from kvsim.core.report import format_table
from kvsim.kernels.presets import resolve_codec
from kvsim.kv.attention_error import attention_output
from kvsim.kv.capture_file import CAPTURE_DIR
from kvsim.scenario.codec_timing import TIMING_DIR, timing_doc_from_rows

COMMAND = ("bench", "codecs")
# kv_source=auto: this capture (written by `kvsim quality`) if present, else synthetic KV
# from the generator calibrated on it (committed), else the generator's defaults.
DEFAULT_CAPTURE = "smollm2-135m-ctx1024"
DEFAULT_SYNTHETIC_PARAMS = DATA_DIR / "synthetic" / "smollm2-135m.json"
HELP = "codec bits/element, vNMSE and encode/decode GB/s vs torch copy on one KV cache"
CONFIG_NAME = "bench_codecs"

# Every codec preset in conf/codec/ (kept equal to conf/bench_codecs.yaml's list; a test
# checks both, and that each preset file exists).
DEFAULT_CODECS = ["bf16", "int8", "int4", "kivi-2", "kivi-4", "kcvt-4", "gear", "gear-l", "oscar",
                  "lynx", "lynx-int4", "lynx-int8", "lynx-2+6", "lynx-2+2+4", "lynx-oscar",
                  "cachegen"]


# A clone of the cache takes microseconds to milliseconds: many repeats keep its median
# robust to a busy machine (the codecs' own timings take seconds).
COPY_REPEATS = 101


@dataclass
class ShapeConfig:
    """Synthetic KV shape (ignored for captures, which bring their own)."""

    layers: int = 4
    kv_heads: int = 2
    tokens: int = 512
    head_dim: int = 128
    q_heads: int = 8  # query heads (multiple of kv_heads, GQA)
    q_tokens: int = 16  # decode queries per layer for vNMSE
    dtype: str = "bfloat16"


@dataclass
class Config:
    # preset names (conf/codec/<name>.yaml) or mappings {preset|name, params, label}
    codecs: list[Any] = field(default_factory=lambda: list(DEFAULT_CODECS))
    # "auto": the real SmolLM2 capture when `kvsim quality out_dir=data` has made one in
    # data/captures/, else synthetic KV
    # with the generator calibrated on it; "synthetic"; or a capture name / path
    kv_source: str = "auto"
    synthetic_params: str | None = None  # JSON of SyntheticKVParams (null: defaults)
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    seed: int = 0
    repeats: int = 3  # timed runs per codec (median reported)
    warmup: int = 1  # untimed runs before timing
    device: str = "auto"  # cpu | cuda | auto
    progress: bool = True
    # hardware preset name: also write the measured GB/s as a codec timing file
    # <out_dir>/codec_timing/<name>.json (e.g. local-cpu here, h100 on a lent GPU)
    write_timing: str | None = None
    # root of that file; null: the run directory (use it with `kvsim sim codec_timing=PATH`);
    # `data` updates the simulator's shipped data/codec_timing/<name>.json
    out_dir: str | None = None
    overwrite: bool = False  # replace an existing timing file (else refused before measuring)


COLUMNS = [("codec", "codec", ""), ("bits_per_element", "bits/elem", ".3f"),
           ("compression_vs_bf16", "x vs bf16", ".2f"), ("rel_mse", "KV relMSE", ".3g"),
           ("vnmse", "vNMSE", ".3g"), ("vnmse_anchor", "vNMSE anchor", ".3g"),
           ("encode_gbps", "enc GB/s", ".3f"), ("decode_gbps", "dec GB/s", ".3f"),
           ("encode_vs_copy", "enc/copy", ".4f"), ("decode_vs_copy", "dec/copy", ".4f"),
           ("timing_spread", "spread", ".2f"), ("size_estimate_error", "size est err", "+.3f")]
DEVICE_COLUMNS = [("codec", "codec", ""), ("kernel_encode_gbps", "enc kernel GB/s", ".1f"),
                  ("kernel_encode_vs_d2d", "vs d2d", ".3f"),
                  ("encode_with_copy_gbps", "enc+copy GB/s", ".1f"),
                  ("encode_with_copy_vs_pinned", "vs pinned", ".3f"),
                  ("kernel_decode_gbps", "dec kernel GB/s", ".1f"),
                  ("kernel_decode_vs_d2d", "vs d2d", ".3f"),
                  ("decode_with_copy_gbps", "copy+dec GB/s", ".1f"),
                  ("decode_with_copy_vs_pinned", "vs pinned", ".3f"),
                  ("d2d_copy_gbps", "d2d GB/s", ".1f"), ("pinned_d2h_gbps", "d2h GB/s", ".1f")]
# a row whose repeats landed further apart than this (slowest / fastest) gets a warning
NOISY_SPREAD = 1.5


def run(cfg: Config) -> list[dict]:
    specs = [resolve_codec(entry) for entry in cfg.codecs]  # a missing preset is an error
    if not specs:
        raise ValueError("codecs is empty: name at least one codec preset")
    timing_path = None
    if cfg.write_timing:
        timing_path = out_root(cfg.out_dir) / "codec_timing" / f"{cfg.write_timing}.json"
        check_new([timing_path], cfg.overwrite)
    device = resolve_device(cfg.device)
    s = cfg.shape
    kv_source, synthetic_params = cfg.kv_source, cfg.synthetic_params
    if kv_source == "auto":
        kv_source = "synthetic"
        if (CAPTURE_DIR / f"{DEFAULT_CAPTURE}.pt").is_file():
            kv_source = DEFAULT_CAPTURE
        elif synthetic_params is None and DEFAULT_SYNTHETIC_PARAMS.is_file():
            synthetic_params = str(DEFAULT_SYNTHETIC_PARAMS)
    if kv_source == "synthetic":
        source = synthetic_source(KVShape(s.layers, s.kv_heads, s.tokens, s.head_dim, s.dtype),
                                  s.q_heads, s.q_tokens, cfg.seed, synthetic_params)
    else:
        source = capture_source(kv_source, s.q_heads, s.q_tokens, cfg.seed)
    kv = source.kv.to(device)
    queries = source.queries.to(device)
    shape = KVShape.of(kv)
    o_ref = attention_output(queries, kv)
    rows = []
    for spec in tqdm(specs, desc="bench codecs", unit="codec", file=sys.stderr,
                     disable=not cfg.progress):
        # the copy baseline is re-timed next to each codec, so a ratio compares timings
        # taken under the same machine load
        copy_s = copy_baseline_s(kv, max(cfg.repeats, COPY_REPEATS), max(cfg.warmup, 1))
        row = bench_codec(spec.label, spec.build(), kv, queries, o_ref, copy_s, cfg.repeats,
                          cfg.warmup)
        row.update({"kv_source": source.description["kind"], "shape": shape.to_dict(),
                    "q_heads": int(queries.shape[1]), "q_tokens": int(queries.shape[2])})
        row.update(device_timing(spec.build(), kv, cfg.repeats, cfg.warmup) or {})
        row.update(coder_split(spec.build(), kv, cfg.repeats, cfg.warmup, row["encode_s"],
                               row["decode_s"]) or {})
        rows.append(row)
    print(f"KV {source.description['kind']} {shape.to_dict()}, queries "
          f"{tuple(queries.shape)} ({source.description['queries']}), device {device}, "
          f"torch clone {min(r['copy_gbps'] for r in rows):.2f}.."
          f"{max(r['copy_gbps'] for r in rows):.2f} GB/s (bf16-equivalent, timed per codec)")
    print(format_table(rows, COLUMNS))
    on_device = [r for r in rows if "kernel_encode_gbps" in r]
    if on_device:
        print(f"device path on {on_device[0]['device_name']} (CUDA events; GB/s of "
              "bf16-equivalent input; vs d2d: the input's device copy time / the kernel's; "
              "vs pinned: the wire bytes' pinned copy time / kernel + that copy)")
        print(format_table(on_device, DEVICE_COLUMNS))
    split = [r for r in rows if "quantize_gbps" in r]
    where = (" (quantizer on the device, coder on the host's CPUs: no device path)"
             if device.type == "cuda" else "")
    for r in split:
        print(f"{r['codec']}{where}: encode {r['encode_s']:.3f} s = quantizer (symbols in "
              f"host memory) {r['quantize_s']:.3f} s + rANS coder {r['encode_coder_s']:.3f} s "
              f"({r['coder_share_encode']:.0%}); decode {r['decode_s']:.3f} s = rANS decoder "
              f"{r['decode_coder_s']:.3f} s ({r['coder_share_decode']:.0%}) + reconstruction "
              f"{r['reconstruct_s']:.3f} s")
    host_only = [r["codec"] for r in rows
                 if "kernel_encode_gbps" not in r and "quantize_gbps" not in r]
    if device.type == "cuda" and host_only:
        print("no device path (their GB/s above is the host-bound encode / decode): "
              + ", ".join(host_only), file=sys.stderr)
    noisy = [r for r in rows if r["timing_spread"] > NOISY_SPREAD]
    if noisy:
        print("timings moved between repeats (spread = slowest / fastest, encode or decode): "
              + ", ".join(f"{r['codec']} {r['timing_spread']:.2f}x" for r in noisy)
              + ": the machine's speed changed during the run (README \"Codec speed on this "
              "CPU\"); rerun, or compare only rows of steady spread", file=sys.stderr)
    for r in rows:
        if not r["size_exact"]:
            print(f"{r['codec']}: size est err {r['size_estimate_error']:+.4f} with the size model "
                  f"calibrated on this KV ({r['size_estimate_note']}); "
                  f"{r['size_estimate_uncalibrated_error']:+.3f} uncalibrated "
                  f"({r['size_estimate_uncalibrated_note']})")
    if cfg.write_timing:
        command = (f"kvsim bench codecs (kv_source={source.description['kind']}, shape "
                   f"{shape.to_dict()}, median of {cfg.repeats}, device {device})")
        written = rows
        if device.type == "cuda":
            # a GPU timing file holds the device paths, and CacheGen's host-coder speed
            # (labelled so: it is this host's CPUs' coder); any other codec without a device
            # path keeps the entry it had (its speed above is a torch reference's)
            written = on_device + split
            command += " (device path: kernels alone, CUDA events; host coder: wall clock)"
        doc = timing_doc_from_rows(written, cfg.write_timing, command)
        # keep the other entries and the default of the file replaced (overwrite=true), else of
        # the shipped one, so that the new file stands in for it; replace what was measured
        shipped = TIMING_DIR / f"{cfg.write_timing}.json"
        base = timing_path if timing_path.is_file() else shipped
        if base.is_file():
            old = json.loads(base.read_text())
            doc = {**old, **doc, "codecs": {**old.get("codecs", {}), **doc["codecs"]}}
        timing_path.parent.mkdir(parents=True, exist_ok=True)
        timing_path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"codec timing for hardware {cfg.write_timing!r} written to {timing_path}",
              file=sys.stderr)
    return rows
