from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml

from kvsim.bench.codecs import bench_codec, median_seconds, spread, timed_seconds
from kvsim.cli.main import CONF_DIR, main
from kvsim.commands.bench_codecs import DEFAULT_CODECS
from kvsim.core.device import resolve_device
from kvsim.core.layout import KVShape
from kvsim.kernels.bf16 import BF16Codec
from kvsim.kernels.encoded import Chunk, Encoded
from kvsim.kernels.presets import PRESET_DIR
from kvsim.kv.attention_error import attention_output
from kvsim.kv.synthetic import generate_kv, generate_queries

TINY = ["kv_source=synthetic", "shape.layers=2", "shape.kv_heads=1", "shape.tokens=40",
        "shape.head_dim=16",
        "shape.q_heads=2", "shape.q_tokens=3", "repeats=1", "warmup=0", "device=cpu",
        "progress=false"]


def _run(tmp_path, *overrides):
    path = tmp_path / "report.json"
    assert main(["bench", "codecs", *TINY, *overrides, f"report={path}"]) == 0
    return json.loads(path.read_text())


def test_report_rows_are_consistent(tmp_path, capsys):
    doc = _run(tmp_path, "codecs=[bf16,cachegen]")
    out = capsys.readouterr().out
    assert "bits/elem" in out and "cachegen" in out
    rows = doc["rows"]
    assert [r["codec"] for r in rows] == ["bf16", "cachegen"]
    numel = 2 * 2 * 1 * 40 * 16
    for row in rows:
        for key in ("codec", "bits_per_element", "stream_bytes", "vnmse", "encode_gbps",
                    "decode_gbps", "device", "copy_gbps", "rel_mse", "vnmse_prefix"):
            assert key in row, key
        assert row["device"] == "cpu"
        assert math.isclose(row["bits_per_element"], 8 * row["serialized_bytes"] / numel)
        assert row["serialized_bytes"] == row["header_bytes"] + sum(row["stream_bytes"])
        assert math.isclose(row["encode_vs_copy"], row["encode_gbps"] / row["copy_gbps"])
        assert math.isclose(row["encode_gbps"], 2 * numel / 1e9 / row["encode_s"])
        assert row["vnmse_prefix"][-1] == row["vnmse"]
        assert len(row["vnmse_layers"]) == 2
        assert row["timing_spread"] == max(row["encode_spread"], row["decode_spread"]) >= 1.0
        assert math.isclose(float(np.mean(row["vnmse_layers"])), row["vnmse"])
        assert row["vnmse_anchor"] is None  # single-stream codecs
    bf16, cachegen = rows
    assert bf16["size_exact"] and bf16["size_estimate_error"] == 0.0
    assert not cachegen["size_exact"]
    # cachegen's estimate is calibrated on a sample of the bench's own KV, and both the
    # calibrated and the shipped-file errors are reported, each with its source
    assert "bench KV sample" in cachegen["size_estimate_note"]
    assert "error unknown" in cachegen["size_estimate_uncalibrated_note"]
    assert abs(cachegen["size_estimate_error"]) < 0.10
    assert "size est err" in out and "uncalibrated" in out
    assert bf16["vnmse"] == 0.0 and bf16["rel_mse"] == 0.0  # bf16 source, bf16 codec
    assert 0 < cachegen["vnmse"] < 1 and 0 < cachegen["rel_mse"] < 1
    assert doc["config"]["shape"]["tokens"] == 40


def test_mapping_entries_and_missing_preset(tmp_path, capsys):
    doc = _run(tmp_path, "codecs=[{preset: cachegen, params: {k_bits: [4, 2], v_bits: [4, 2]},"
                         " label: cg-low}]")
    assert doc["rows"][0]["codec"] == "cg-low"
    assert doc["rows"][0]["params"]["k_bits"] == [4, 2]
    assert main(["bench", "codecs", *TINY, "codecs=[no-such-preset]"]) == 1
    assert "no-such-preset" in capsys.readouterr().err


def test_default_codec_list_names_existing_presets():
    missing = [name for name in DEFAULT_CODECS if not (PRESET_DIR / f"{name}.yaml").is_file()]
    assert not missing, f"default codecs without a preset file: {missing}"
    conf = yaml.safe_load((CONF_DIR / "bench_codecs.yaml").read_text())
    assert conf["codecs"] == DEFAULT_CODECS  # the schema default and the yaml agree


class _SplitBF16(BF16Codec):
    """A two-stream codec for the test: stream 0 = high byte of each bf16 (sign, exponent,
    1 mantissa bit), stream 1 = low byte. Not registered."""

    name = "test-split-bf16"

    def stream_names(self) -> list[str]:
        return ["high", "low"]

    def payload_bytes(self, shape: KVShape) -> np.ndarray:
        half = super().payload_bytes(shape)[0] // 2
        return np.stack([half, half])

    def has_device_path(self, device, shape) -> bool:
        return False  # encodes through _encode below

    def _encode(self, kv, shape):
        (chunks,) = BF16Codec(self.params).encode(kv).streams
        return [[Chunk(s, c.layer, c.page, c.payload[1 - s :: 2].copy()) for c in chunks]
                for s in (0, 1)]

    def _decode(self, enc: Encoded, streams: int, device):
        merged = Encoded("bf16", enc.params, enc.shape, enc.page_tokens, ["full"], [[]])
        low = enc.payloads(1) if streams > 1 else {}
        for (layer, page), high in enc.payloads(0).items():
            both = np.zeros(2 * high.size, dtype=np.uint8)
            both[1::2] = high
            if low:
                both[0::2] = low[(layer, page)]
            merged.streams[0].append(Chunk(0, layer, page, both))
        return BF16Codec(self.params).decode(merged, device=device)


def test_split_codec_prefix_metrics():
    kv = generate_kv(KVShape(2, 1, 64, 16, "bfloat16"), seed=3)
    queries = generate_queries(kv, 2, 4, seed=3)
    o_ref = attention_output(queries, kv)
    row = bench_codec("split", _SplitBF16(), kv, queries, o_ref, copy_s=1e-3, repeats=1,
                      warmup=0)
    assert len(row["vnmse_prefix"]) == 2 and len(row["bits_per_element_prefix"]) == 2
    assert row["vnmse_anchor"] == row["vnmse_prefix"][0] > 0  # high byte only: lossy
    assert row["vnmse"] == 0.0 and row["rel_mse"] == 0.0  # both streams: exact
    assert row["rel_mse_prefix"][0] > 0
    assert row["stream_bytes"][0] == row["stream_bytes"][1]
    assert row["bits_per_element_prefix"][0] < row["bits_per_element_prefix"][1] \
        == row["bits_per_element"]


def test_device_and_timing_helpers():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    calls = []
    assert median_seconds(lambda: calls.append(1), repeats=3, warmup=2,
                          device=torch.device("cpu")) >= 0
    assert len(calls) == 5
    with pytest.raises(ValueError, match="repeats"):
        median_seconds(lambda: None, 0, 0, torch.device("cpu"))
    assert len(timed_seconds(lambda: None, 4, 0, torch.device("cpu"))) == 4
    assert spread([0.2, 0.1, 0.15]) == 2.0 and spread([0.3]) == 1.0
    assert spread([0.0, 1.0]) == math.inf


def test_repeats_far_apart_are_flagged(tmp_path, monkeypatch, capsys):
    """A codec whose repeats land far apart (the host's speed moved) is named on stderr with
    its spread; steady ones are not."""
    import kvsim.bench.codecs as bench

    times = {"n": 0}

    def fake_timed(fn, repeats, warmup, device):  # calls: copy, encode, decode per codec
        fn()
        times["n"] += 1
        return [0.01, 0.03] if times["n"] == 5 else [0.01, 0.011]  # int8 encode

    monkeypatch.setattr(bench, "timed_seconds", fake_timed)
    doc = _run(tmp_path, "codecs=[bf16,int8]", "repeats=2")
    spreads = {r["codec"]: r["timing_spread"] for r in doc["rows"]}
    assert spreads["bf16"] == pytest.approx(1.1) and spreads["int8"] == pytest.approx(3.0)
    err = capsys.readouterr().err
    assert "int8 3.00x" in err and "bf16" not in err.split("timings moved")[1]


def test_write_timing_feeds_the_simulator(tmp_path, monkeypatch, capsys):
    """write_timing goes to the run directory (named here with hydra.run.dir), keeps the
    shipped file's other entries, never touches data/, and an existing file needs
    overwrite=true."""
    from kvsim.core.data_files import sha256_file
    from kvsim.scenario.codec_timing import TIMING_DIR, load_codec_timing

    shipped = TIMING_DIR / "h100.json"
    shipped_sha = sha256_file(shipped)
    monkeypatch.chdir(tmp_path)
    args = ["bench", "codecs", *TINY, "codecs=[bf16,int4]", "write_timing=h100",
            f"report={tmp_path / 'r.json'}", f"hydra.run.dir={tmp_path}"]
    assert main(args) == 0
    path = tmp_path / "codec_timing" / "h100.json"
    rows = {r["codec"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    table = load_codec_timing("h100", path)
    timing = table.lookup("int4", "uniform")
    assert timing.encode_s(1e9) == pytest.approx(1.0 / rows["int4"]["encode_gbps"])
    old = load_codec_timing("h100")  # the shipped entries the run did not measure are kept
    assert table.lookup("lynx", "lynx") == old.lookup("lynx", "lynx")
    assert sha256_file(shipped) == shipped_sha
    written = path.read_bytes()
    capsys.readouterr()
    assert main(args) == 1  # refused before measuring
    err = capsys.readouterr().err
    assert str(path) in err and "overwrite=true" in err
    assert path.read_bytes() == written
    assert main([*args, "overwrite=true"]) == 0
    rows = {r["codec"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    timing = load_codec_timing("h100", path).lookup("int4", "uniform")
    assert timing.encode_s(1e9) == pytest.approx(1.0 / rows["int4"]["encode_gbps"])


def test_cachegen_is_split_into_quantizer_and_coder(tmp_path, capsys):
    """CacheGen's calls are timed whole and split into the quantizer and the rANS coder
    (kvsim.bench.coder_split); a timing file keeps the split beside the whole calls' speed,
    labelled with how it was timed."""
    from kvsim.bench.coder_split import CPU_CODER_TIMING
    from kvsim.scenario.codec_timing import timing_doc_from_rows

    doc = _run(tmp_path, "codecs=[int8,cachegen]")
    rows = {r["codec"]: r for r in doc["rows"]}
    assert "quantize_s" not in rows["int8"]
    row = rows["cachegen"]
    assert row["timing"] == CPU_CODER_TIMING and row["quantize_s"] > 0
    assert row["decode_coder_s"] > 0 and 0 <= row["coder_share_decode"] <= 1
    assert row["encode_coder_s"] == pytest.approx(max(row["encode_s"] - row["quantize_s"], 0))
    assert row["coder_share_encode"] == pytest.approx(row["encode_coder_s"] / row["encode_s"])
    out = capsys.readouterr().out
    assert "cachegen: encode" in out and "rANS coder" in out and "on the device" not in out
    entry = timing_doc_from_rows([row], "local-cpu", "cmd")["codecs"]["cachegen"]
    assert entry["source"] == "measured" and entry["timing"] == CPU_CODER_TIMING
    assert entry["quantize_s"] == row["quantize_s"] and "kernel_encode_vs_d2d" not in entry


@pytest.mark.gpu
def test_cachegen_split_on_a_gpu():
    from kvsim.bench.coder_split import HOST_CODER_TIMING, coder_split
    from kvsim.kernels.codec import make_codec

    kv = (torch.randn(4, 2, 4, 1024, 64) * 2).to(torch.bfloat16).cuda()
    codec = make_codec("cachegen", {})
    enc = codec.encode(kv)
    encode_s = median_seconds(lambda: codec.encode(kv), 3, 1, kv.device)
    decode_s = median_seconds(lambda: codec.decode(enc, device=kv.device), 3, 1, kv.device)
    row = coder_split(codec, kv, 3, 1, encode_s, decode_s)
    assert row["timing"] == HOST_CODER_TIMING and row["device_name"]
    assert 0 < row["quantize_s"] and 0 < row["decode_coder_s"]
    assert 0 <= row["coder_share_encode"] <= 1 and 0 <= row["coder_share_decode"] <= 1
