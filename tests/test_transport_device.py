"""The real transport on a device (`device=cuda`): the sender's KV made and encoded there, the
decode host's caches dequantized into its memory and decoded there. What needs no GPU (the
names, refusals and the sources' moves) runs everywhere; the whole pipeline is `gpu`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvsim.core.compose import compose
from kvsim.core.device import check_device_name, device_label, resolve_device
from kvsim.core.layout import KVShape
from kvsim.transport import session
from kvsim.transport.config import EmulateConfig
from kvsim.transport.source import synthetic_source

BASE = ["transport.kv_source=synthetic", "transport.decode=timing", "codecs=[int8]",
        "workload.context_tokens=64", "workload.output_tokens=4"]


def config(*overrides: str) -> EmulateConfig:
    cfg, _ = compose("transport", [*BASE, *overrides], EmulateConfig)
    return cfg


def test_device_names_are_checked_before_anything_runs():
    for name in ("cpu", "cuda", "cuda:1", "auto"):
        check_device_name(name)
    for name in ("tpu", "cuda:", "cuda:x", "gpu", ""):
        with pytest.raises(ValueError, match="device must be"):
            check_device_name(name)
    cfg = config("device=tpu")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"):
        cfg.validate()
    config().validate()  # the default: the CPU
    assert config().device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_a_cuda_device_this_host_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device("cuda")
    cfg = config("device=cuda")
    cfg.validate()  # a name only: whether the host has it is asked when the ends start
    with pytest.raises(ValueError, match="device=cuda requested"):
        session.kv_device(cfg)
    assert resolve_device("auto") == torch.device("cpu")


def test_the_prefix_store_is_refused_on_a_device(monkeypatch):
    cfg = config("device=cuda", "prefix_cache.enabled=true",
                 "prefix_cache.prefill_capacity_gb=0", "prefix_cache.store_capacity_gb=0")
    monkeypatch.setattr("kvsim.core.device.resolve_device", lambda name: torch.device("cuda"))
    with pytest.raises(ValueError, match="prefix store keeps its blocks in host memory"):
        session.kv_device(cfg)


def test_a_source_hands_its_layers_out_on_its_device():
    """Synthetic KV is made on the host and moved to the source's device: layer by layer,
    or whole in `prepare` (while a modelled prefill runs, so the move is not the encode's).
    The meta device stands in for a GPU: the moves are real, the data is not."""
    shape = KVShape(layers=2, kv_heads=1, tokens=16, head_dim=8)
    meta = torch.device("meta")
    lazy = synthetic_source(shape, 0.0, seed=3, device=meta)
    assert lazy.describe["device"] == "meta"
    first = lazy.layer(0)
    assert first.device == meta and tuple(first.shape) == (1, 2, 1, 16, 8)
    assert lazy.full().device == meta
    held = synthetic_source(shape, 0.0, seed=3, device=meta)
    assert held.prepare(budget_bytes=shape.bf16_bytes) and held._kv.device == meta
    small = synthetic_source(shape, 0.0, seed=3, device=meta)
    assert not small.prepare(budget_bytes=shape.bf16_bytes - 1)  # too large to hold whole
    assert small.layer(1).device == meta  # still on its device, one layer at a time
    on_cpu = synthetic_source(shape, 0.0, seed=3)
    assert on_cpu.describe["device"] == "cpu" and on_cpu.layer(0).device.type == "cpu"
    assert device_label(torch.device("cpu")) == "cpu"


def test_emulate_splits_one_devices_memory_between_its_two_ends(monkeypatch):
    """kvsim emulate runs both ends on one device: the decode host's caches get half of what
    is free there after each end's fp32 model; too little for that is refused by name."""
    from kvsim.transport import emulate as em

    gib = 1 << 30
    monkeypatch.setattr(em, "_device_free_bytes_in_a_child", lambda device: 100 * gib)
    both = config("model=llama-3.1-8b", "transport.kv_source=live", "transport.decode=real")
    fp32_model = 4 * both.model.params_total
    assert em._shared_device_budget(both, torch.device("cuda")) == \
        int((100 * gib - 2 * fp32_model) / 2)
    modelled = config("model=llama-3.1-8b")  # synthetic KV, timing decode: no model loaded
    assert em._shared_device_budget(modelled, torch.device("cuda")) == 50 * gib
    monkeypatch.setattr(em, "_device_free_bytes_in_a_child", lambda device: 40 * gib)
    with pytest.raises(ValueError, match="do not hold both ends' fp32 models"):
        em._shared_device_budget(both, torch.device("cuda"))


# ---- the whole pipeline on a GPU -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("codecs", "dequantize"), [
    ("bf16,int8", "on_arrival"),  # the simplest device paths, both receivers
    ("bf16,int8", "on_demand"),
    ("lynx,gear", "on_arrival"),  # split-stream drafting; GEAR's fit kernel
])
def test_emulate_on_a_gpu_prefills_encodes_dequantizes_and_decodes_there(tmp_path, codecs,
                                                                         dequantize):
    """`kvsim emulate device=cuda` with the tiny random Llama: a live prefill on the GPU,
    int8 / lynx / gear encoded by their device paths, bf16 by its strided copies, each
    request's layers dequantized into the GPU's memory and decoded there by the real model;
    every request done, each row naming the devices both ends used."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvsim", "emulate", "model=tiny-random", "device=cuda",
         "transport.kv_source=live", "transport.decode=real", f"codecs=[{codecs}]",
         "workload.context_tokens=512", "workload.output_tokens=16",
         "link.bandwidth_gbps=0.5", f"transport.dequantize={dequantize}", f"report={report}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(report.read_text())["rows"]
    assert len(rows) == 2 and [r["status"] for r in rows] == ["done"] * 2, \
        [(r.get("codec"), r.get("error")) for r in rows]
    for r in rows:
        assert r["decode"] == "real" and r["decode_device"].startswith("cuda:"), r
        assert r["kv_source"]["device"].startswith("cuda:"), r["kv_source"]
        assert len(r["token_ids"]) == 16 and r["ttft_s"] > 0
