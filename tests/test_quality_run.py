"""`kvsim quality` end to end: on the tiny random Llama (fast) and on SmolLM2-135M (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvsim.model.presets import load_model_preset
from kvsim.quality.run import AcceptanceRunConfig, QualityConfig, run_quality
from kvsim.quality.vnmse import load_vnmse_table
from kvsim.scenario.acceptance import load_acceptance


def _tiny_cfg(tmp_path, **kw) -> QualityConfig:
    spec = AcceptanceRunConfig(max_draft=6, decoding=["greedy"], prefixes="all")
    base = dict(model=load_model_preset("tiny-random"), codecs=["bf16"], context_tokens=48,
                heldout_tokens=8, runs=2, speculative=spec, out_dir=str(tmp_path), progress=False)
    return QualityConfig(**{**base, **kw})


def test_tiny_end_to_end_writes_loadable_files(tmp_path):
    rows, summary = run_quality(_tiny_cfg(tmp_path))
    assert len(rows) == 1
    row = rows[0]
    for key in ("codec", "streams_used", "vnmse", "top1_agreement", "proposed_mean",
                "accepted_mean", "survival"):
        assert key in row
    assert row["codec"] == "bf16" and row["streams_used"] == 1
    assert 0 < row["vnmse"] < 1e-3  # bf16 rounding of a float32 cache
    assert row["proposed_mean"] == 6 and 0 <= row["accepted_mean"] <= 6
    assert row["survival"][0] == 1.0 and len(row["survival"]) == 7
    model = load_acceptance(str(tmp_path / "acceptance" / f"{row['acceptance_model']}.json"))
    assert model.meta["model"] == "tiny-random" and model.meta["runs"] == 2
    assert model.survival == [row["survival"][k] for k in range(7)]
    table = load_vnmse_table(summary["files"]["vnmse"])
    assert table.lookup("bf16")["vnmse"] == pytest.approx(row["vnmse"])
    assert (tmp_path / "captures" / "tiny-random-ctx48.pt").is_file()
    assert (tmp_path / "synthetic" / "tiny-random.json").is_file()


def test_partial_prefixes_skip_single_stream_codecs(tmp_path):
    cfg = _tiny_cfg(tmp_path, runs=1, write_files=False,
                    speculative=AcceptanceRunConfig(max_draft=4, prefixes="partial"))
    rows, summary = run_quality(cfg)
    assert rows[0]["survival"] is None and rows[0]["accepted_mean"] is None
    assert summary["files"] == {}


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="prefixes"):
        run_quality(_tiny_cfg(tmp_path, speculative=AcceptanceRunConfig(prefixes="some")))
    with pytest.raises(ValueError, match="decoding"):
        run_quality(_tiny_cfg(tmp_path, speculative=AcceptanceRunConfig(decoding=["beam"])))
    with pytest.raises(ValueError, match="unknown codec preset"):
        run_quality(_tiny_cfg(tmp_path, codecs=["no-such-codec"]))


def test_cli_with_report(tmp_path):
    report = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvsim", "quality", "model=tiny-random", "codecs=[bf16]",
         "context_tokens=32", "heldout_tokens=4", "runs=1", "speculative.max_draft=3",
         "speculative.prefixes=all", f"out_dir={tmp_path}", "progress=false",
         f"report={report}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "vNMSE" in proc.stdout and "bf16" in proc.stdout
    doc = json.loads(report.read_text())
    assert doc["config"]["model"]["name"] == "tiny-random"
    assert doc["rows"][0]["survival"]["0"] == 1.0


@pytest.mark.slow
def test_smollm2_real_model(tmp_path):
    """SmolLM2-135M on real text: codec error is ordered by precision and greedy speculative
    decoding on a quantized draft cache is lossless."""
    from kvsim.kernels.presets import resolve_codec
    from kvsim.kv.capture import run_context
    from kvsim.kv.draft_verify import decode, speculative_round
    from kvsim.kv.text import assemble
    from kvsim.model.fetch import cached_gguf_path
    from kvsim.model.load import load_lm
    from kvsim.quality.vnmse import cache_error

    preset = load_model_preset("smollm2-135m")
    if not cached_gguf_path(preset).is_file():
        pytest.fail("SmolLM2-135M weights missing: run `kvsim model fetch` first")
    lm = load_lm(preset, threads=2)
    from kvsim.core.data_files import loaded_files, repo_relative, sha256_file

    gguf = cached_gguf_path(preset).resolve()  # the weights are in the run's provenance
    assert {"path": repo_relative(gguf), "sha256": sha256_file(gguf),
            "size_bytes": gguf.stat().st_size} in loaded_files()
    sample = assemble(lm.tokenizer, 256 + 16, "stdlib-docs", 0)
    ctx, held = sample.ids[:256], sample.ids[256:]
    ref = run_context(lm.model, ctx, held)
    assert ref.kv.shape == (30, 2, 3, 256, 64)
    held_t = torch.tensor(held)
    errs = {}
    for name in ["bf16", "int8", "int4", "lynx"]:
        codec = resolve_codec(name).build()
        kv_hat = codec.decode(codec.encode(ref.kv), dtype=torch.float32)
        errs[name] = cache_error(lm.model, ref.kv, kv_hat, ref.queries, held_t,
                                 ref.heldout_logits)
    assert errs["bf16"].vnmse < 1e-3 and errs["bf16"].top1_agreement >= 0.9
    assert errs["bf16"].vnmse < errs["int8"].vnmse < errs["int4"].vnmse
    assert errs["lynx"].vnmse < errs["int4"].vnmse  # anchor + residual: an 8-bit code
    # lossless greedy speculation with a coarse draft cache (bf16 + heavy noise)
    first = int(ref.last_logits.argmax())
    gen = torch.Generator().manual_seed(0)
    noisy = ref.kv + 0.5 * ref.kv.std() * torch.randn(ref.kv.shape, generator=gen)
    rnd = speculative_round(lm.model, noisy, ref.kv, first, 8, "greedy")
    target_only, _ = decode(lm.model, ref.kv, first, 9)
    assert rnd.emitted == target_only[: len(rnd.emitted)]
    # and drafting on the real lynx anchor-only cache, verified on the full one
    lynx = resolve_codec("lynx").build()
    anchor = lynx.decode(lynx.encode(ref.kv), streams=1, dtype=torch.float32)
    rnd = speculative_round(lm.model, anchor, ref.kv, first, 8, "greedy")
    assert rnd.emitted == target_only[: len(rnd.emitted)]
