"""Which KV a simulation's estimated chunk sizes are measured on (`size_calibration`).

Most codecs know their bytes from the shape alone. CacheGen's entropy-coded bytes depend on
the KV's statistics (45x apart between constant and real KV), so the simulator must say whose
statistics it uses:
- `file`: the codec's shipped size model (data/cachegen_ratio.json, measured on a SmolLM2
  capture); its error on the simulated model's KV is unknown, and the row says so;
- `synthetic`: a sample encode of kvsim.kv.synthetic KV with the simulated model's KV shape
  (heads, head_dim, layers; SAMPLE_TOKENS tokens), held-out error stated;
- a capture name or path: a sample encode of that real capture (its shape, not the model's).
Calibrations are cached per (codec, source, shape) for the process: a sweep measures once.
"""

from __future__ import annotations

import functools
import json

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import Codec

SAMPLE_TOKENS = 2048  # tokens of the synthetic sample (rates are per symbol: they extrapolate)
SAMPLE_CHUNKS = 16  # (layer, page) chunks coded to measure the rates


def check_size_calibration(value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError("size_calibration must be 'file', 'synthetic' or a capture name/path, "
                         f"got {value!r}")
    if value not in ("file", "synthetic"):
        from kvsim.kv.capture_file import resolve_capture_path

        try:
            resolve_capture_path(value)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"size_calibration={value!r} is neither 'file', 'synthetic' nor "
                             f"a readable capture ({exc})") from None


def calibrate_sizes(codec: Codec, calibration: str, model_shape: KVShape) -> None:
    """Give an estimated-size codec its size model for this simulation (exact codecs and
    `file` are left as they are). model_shape: the simulated model's KV shape (any tokens)."""
    if codec.exact_sizes or calibration == "file":
        return
    model = _measured(codec.name, json.dumps(codec.params_dict(), sort_keys=True), calibration,
                      model_shape.layers, model_shape.kv_heads, model_shape.head_dim,
                      model_shape.dtype)
    codec.use_size_model(model)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=64)
def _measured(codec_name: str, params_json: str, calibration: str, layers: int, kv_heads: int,
              head_dim: int, dtype: str):
    from kvsim.kernels.codec import make_codec

    codec = make_codec(codec_name, json.loads(params_json))
    if calibration == "synthetic":
        from kvsim.kv.synthetic import SyntheticKVParams, generate_layer

        shape = KVShape(layers, kv_heads, SAMPLE_TOKENS, head_dim, dtype)
        params = SyntheticKVParams()
        source = {"kind": "synthetic", "name": f"KV of shape {shape.to_dict()}",
                  "synthetic_params": params.to_dict()}
        return codec.calibrate(lambda layer: generate_layer(shape, layer, params), shape,
                               source, SAMPLE_CHUNKS)
    from kvsim.kv.capture_file import load_capture, resolve_capture_path

    cap = load_capture(calibration)
    source = {"kind": "capture", "name": str(resolve_capture_path(calibration)),
              "meta": cap.meta}
    return codec.calibrate(lambda layer: cap.kv[layer], KVShape.of(cap.kv), source,
                           SAMPLE_CHUNKS)
