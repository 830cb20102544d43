"""Codec encode / decode throughput per hardware: data/codec_timing/<hardware>.json.

Throughputs are GB/s (1e9 bytes/s) of *bf16-equivalent input*: the time to encode or to
deserialize+dequantize a chunk is (its bf16 size) / throughput, whatever its wire size.
They are per device; an instance with `devices` tensor-parallel devices holds 1/devices of
every chunk on each device, so the instance's throughput scales with `devices`.

File format (version 1):
  {"version": 1, "hardware": "<preset>",
   "codecs": {"<codec label or registered name>": {"encode_gb_per_s": x, "decode_gb_per_s": y,
               "source": "measured" | "assumed", ...provenance,
               "anchor_decode_gb_per_s": z,     (optional: stream 0 alone, default y)
               "layer_job_fixed_s": f, "layer_job_gb_per_s": r,              (optional)
               "anchor_layer_job_fixed_s": fa, "anchor_layer_job_gb_per_s": ra}}, (optional)
   "default": {... same fields, used for codecs not listed ...}}            (optional)
The layer_job fields time the transport receiver's on-arrival worker, which dequantizes one
layer per job: a job costs f + (the layer's bf16 bytes) / r, a fixed part (the job's Python,
kernel calls and cache update, the same at any context) and a part in proportion to its
bytes. `kvsim calibrate` fits them from its calibration transfers at two contexts;
deserializer=on_arrival times its layer jobs with them (kvsim.scenario.policy) and, where they
are absent, with decode_gb_per_s / anchor_decode_gb_per_s alone (a job in proportion to its
bytes, which overstates a long context's jobs when the fixed part is large).
Every entry states its `source`: "measured" entries name the `command` and `device` that
produced them (`kvsim bench codecs report=PATH` rows: codec, encode_gbps, decode_gbps,
device; see `from_bench_report`), "assumed" entries carry an `assumption` sentence.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.core.data_files import record_loaded
from kvsim.core.paths import DATA_DIR

TIMING_DIR = DATA_DIR / "codec_timing"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CodecTiming:
    encode_gb_per_s: float
    decode_gb_per_s: float
    source: str
    note: str = ""
    # dequantizing stream 0 alone (a split-stream codec's anchor), GB/s of bf16 output;
    # nan: as decode_gb_per_s
    anchor_decode_gb_per_s: float = math.nan
    # one on-arrival layer job: fixed s + bf16 bytes at GB/s (nan: decode_s alone), every
    # stream's (full) and stream 0's alone (anchor)
    layer_job_fixed_s: float = math.nan
    layer_job_gb_per_s: float = math.nan
    anchor_layer_job_fixed_s: float = math.nan
    anchor_layer_job_gb_per_s: float = math.nan

    def encode_s(self, bf16_bytes: float, devices: int = 1) -> float:
        return bf16_bytes / (self.encode_gb_per_s * 1e9 * devices)

    def decode_s(self, bf16_bytes: float, devices: int = 1) -> float:
        return bf16_bytes / (self.decode_gb_per_s * 1e9 * devices)

    def anchor_decode_s(self, bf16_bytes: float, devices: int = 1) -> float:
        """Dequantizing only stream 0 of a cache of `bf16_bytes` (s)."""
        rate = self.decode_gb_per_s if math.isnan(self.anchor_decode_gb_per_s) \
            else self.anchor_decode_gb_per_s
        return bf16_bytes / (rate * 1e9 * devices)

    def layer_job_s(self, layer_bf16_bytes: float | np.ndarray, devices: int = 1,
                    anchor: bool = False) -> float | np.ndarray:
        """Seconds of the on-arrival worker's job on a layer of `layer_bf16_bytes` (a float
        or an array of them): every stream's, or stream 0's alone with `anchor`. The fitted
        fixed + proportional cost where calibrated, else the plain throughput. On `devices`
        tensor-parallel devices each device's worker takes 1/devices of the bytes, in
        parallel, and pays the fixed part once."""
        fixed, rate = (self.anchor_layer_job_fixed_s, self.anchor_layer_job_gb_per_s) \
            if anchor else (self.layer_job_fixed_s, self.layer_job_gb_per_s)
        if math.isnan(fixed) or math.isnan(rate):
            plain = self.anchor_decode_s if anchor else self.decode_s
            return plain(layer_bf16_bytes, devices)
        return fixed + layer_bf16_bytes / (rate * 1e9 * devices)


LAYER_JOB_KEYS = ("layer_job_fixed_s", "layer_job_gb_per_s", "anchor_layer_job_fixed_s",
                  "anchor_layer_job_gb_per_s")


def _layer_job_fields(doc: dict, where: str) -> dict[str, float]:
    """The optional layer-job fit of a codec entry: both halves of a pair or neither, the
    fixed part finite and >= 0 s, the rate finite and > 0 GB/s."""
    out: dict[str, float] = {}
    for fixed_key, rate_key in (LAYER_JOB_KEYS[:2], LAYER_JOB_KEYS[2:]):
        if (fixed_key in doc) != (rate_key in doc):
            raise ValueError(f"{where}: {fixed_key} and {rate_key} go together")
        if fixed_key not in doc:
            continue
        fixed, rate = doc[fixed_key], doc[rate_key]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool)
                      for v in (fixed, rate))
        if not (numbers and math.isfinite(fixed) and fixed >= 0 and math.isfinite(rate)
                and rate > 0):
            raise ValueError(f"{where}: {fixed_key} must be finite and >= 0 s and {rate_key} "
                             f"finite and > 0 GB/s, got {fixed!r} and {rate!r}")
        out[fixed_key], out[rate_key] = float(fixed), float(rate)
    return out


def _entry(doc: dict, where: str) -> CodecTiming:
    for key in ("encode_gb_per_s", "decode_gb_per_s", "source"):
        if key not in doc:
            raise ValueError(f"{where}: missing {key!r}")
    if doc["source"] not in ("measured", "assumed"):
        raise ValueError(f"{where}: source must be 'measured' or 'assumed', got {doc['source']!r}")
    if doc["source"] == "measured" and not ("command" in doc and "device" in doc):
        raise ValueError(f"{where}: a measured entry must name its `command` and `device`")
    if doc["source"] == "assumed" and "assumption" not in doc:
        raise ValueError(f"{where}: an assumed entry must state its `assumption`")
    enc, dec = float(doc["encode_gb_per_s"]), float(doc["decode_gb_per_s"])
    anchor = float(doc.get("anchor_decode_gb_per_s", math.nan))
    if not (enc > 0 and dec > 0 and math.isfinite(enc) and math.isfinite(dec)) or \
            anchor <= 0 or math.isinf(anchor):
        raise ValueError(f"{where}: throughputs must be finite and > 0 GB/s")
    note = doc.get("assumption") or f"{doc.get('command')} on {doc.get('device')}"
    if doc.get("timing"):  # how it was timed (device path kernels, a host coder)
        note += f"; {doc['timing']}"
    return CodecTiming(enc, dec, doc["source"], note, anchor,
                       **_layer_job_fields(doc, where))


class CodecTimingTable:
    def __init__(self, hardware: str, entries: dict[str, CodecTiming],
                 default: CodecTiming | None, path: Path | None = None) -> None:
        self.hardware, self.entries, self.default, self.path = hardware, entries, default, path

    def lookup(self, label: str, name: str) -> CodecTiming:
        """By codec label (e.g. 'lynx-2+6'), then registered name ('lynx'), then default."""
        for key in (label, name):
            if key in self.entries:
                return self.entries[key]
        if self.default is not None:
            return self.default
        raise ValueError(f"no codec timing for {label!r} ({name}) on {self.hardware} in "
                         f"{self.path}; add an entry (measured or stated assumption)")


def load_codec_timing(hardware: str, path: str | Path | None = None) -> CodecTimingTable:
    """The codec timing of a hardware preset (data/codec_timing/<hardware>.json), or of
    `path`: a file, or the name of a shipped calibrated profile (kvsim.core.profiles)."""
    if path:
        from kvsim.core.profiles import profile_path

        try:
            p = profile_path("codec_timing", str(path))
        except ValueError as exc:
            raise ValueError(f"no codec timing file {path!r}: {exc}") from None
    else:
        p = TIMING_DIR / f"{hardware}.json"
    if not p.is_file():
        raise ValueError(f"no codec timing file for hardware {hardware!r} ({p}); write one "
                         "from `kvsim bench codecs` or with stated assumptions")
    doc = json.loads(p.read_text())
    record_loaded(p)  # provenance: path and sha256 in every report (kvsim.core.data_files)
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"{p}: codec timing version {doc.get('version')} != {FORMAT_VERSION}")
    entries = {k: _entry(v, f"{p}: codecs.{k}") for k, v in (doc.get("codecs") or {}).items()}
    default = _entry(doc["default"], f"{p}: default") if doc.get("default") else None
    return CodecTimingTable(doc.get("hardware", hardware), entries, default, p)


def from_bench_report(report_path: str | Path, hardware: str, command: str) -> dict:
    """Turn a `kvsim bench codecs report=PATH` JSON (rows with codec, encode_gbps,
    decode_gbps [GB/s of bf16 input], device) into a codec timing document."""
    doc = json.loads(Path(report_path).read_text())
    return timing_doc_from_rows(doc.get("rows", []), hardware, command, str(report_path))


def timing_doc_from_rows(rows: list[dict], hardware: str, command: str,
                         where: str = "bench rows") -> dict:
    codecs = {}
    for row in rows:
        if not {"codec", "encode_gbps", "decode_gbps"} <= set(row):
            raise ValueError(f"{where}: bench row lacks codec/encode_gbps/decode_gbps: "
                             f"{sorted(row)}")
        entry = {"encode_gb_per_s": row["encode_gbps"], "decode_gb_per_s": row["decode_gbps"],
                 "source": "measured", "command": command,
                 "device": row.get("device", "unknown"), "shape": row.get("shape")}
        if "kernel_encode_gbps" in row:  # the device path of a GPU (bench/device_codecs.py)
            entry.update({
                "encode_gb_per_s": row["kernel_encode_gbps"],
                "decode_gb_per_s": row["kernel_decode_gbps"],
                "timing": "device path, kernels alone (CUDA events)",
                "device_name": row.get("device_name"),
                **{key: row[key] for key in DEVICE_KEYS if key in row}})
        elif "quantize_gbps" in row:  # CacheGen's quantizer and coder (bench/coder_split.py)
            entry.update({"timing": row["timing"],
                          **{key: row[key] for key in CODER_SPLIT_KEYS if key in row}})
        codecs[row["codec"]] = entry
    stack = measuring_stack()
    for entry in codecs.values():  # per entry: a file may gather entries of several runs
        entry["measured_with"] = stack
    return {"version": FORMAT_VERSION, "hardware": hardware, "codecs": codecs}


# what a quantizer / coder split entry keeps beside its whole calls' GB/s
CODER_SPLIT_KEYS = ("quantize_s", "encode_coder_s", "decode_coder_s", "reconstruct_s",
                    "quantize_gbps", "coder_share_encode", "coder_share_decode", "device_name")

# what a device-path timing entry keeps beside its kernel GB/s
DEVICE_KEYS = ("encode_with_copy_gbps", "decode_with_copy_gbps", "d2d_copy_gbps",
               "pinned_d2h_gbps", "kernel_encode_vs_d2d", "kernel_decode_vs_d2d",
               "encode_with_copy_vs_pinned", "decode_with_copy_vs_pinned", "wire_bytes")


def measuring_stack() -> dict:
    """The software and the code a timing file was measured with: torch, Triton, the CUDA
    runtime and driver where there is one, and the commit (kvsim.core.report.git_state)."""
    import subprocess

    import torch

    from kvsim.core.report import git_state

    stack: dict = {"torch": torch.__version__}
    try:
        import triton

        stack["triton"] = triton.__version__
    except ImportError:
        stack["triton"] = None
    if torch.cuda.is_available():
        stack["cuda_runtime"] = torch.version.cuda
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=10)
            stack["driver"] = out.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            stack["driver"] = None
    return {**stack, **git_state()}
