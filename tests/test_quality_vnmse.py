"""Codec error through the model: vNMSE, top-1, perplexity, and the vNMSE table file."""

from __future__ import annotations

import math

import pytest
import torch

from kvsim.kv.capture import run_context
from kvsim.model.tiny import tiny_llama
from kvsim.quality.vnmse import (
    VNMSETable,
    cache_error,
    load_vnmse_table,
    perplexity,
    top1_agreement,
)


def test_perplexity_and_top1():
    logits = torch.zeros(4, 10)
    assert math.isclose(perplexity(logits, torch.tensor([1, 2, 3, 4])), 10.0, rel_tol=1e-6)
    a = torch.eye(4, 10)
    b = a.clone()
    b[0, 7] = 5.0
    assert top1_agreement(a, a) == 1.0 and top1_agreement(a, b) == 0.75


def test_cache_error_grows_with_noise():
    model = tiny_llama(seed=0)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    ref = run_context(model, ids[:32].tolist(), ids[32:].tolist())
    held = ids[32:]
    exact = cache_error(model, ref.kv, ref.kv.clone(), ref.queries, held, ref.heldout_logits)
    assert exact.vnmse == 0.0 and exact.top1_agreement == 1.0 and exact.relative_mse == 0.0
    errors = []
    for noise in (0.01, 0.1, 1.0):
        gen = torch.Generator().manual_seed(0)
        kv_hat = ref.kv + noise * ref.kv.std() * torch.randn(ref.kv.shape, generator=gen)
        err = cache_error(model, ref.kv, kv_hat, ref.queries, held, ref.heldout_logits)
        assert err.vnmse_per_layer.shape == (3,)
        errors.append(err)
    assert errors[0].vnmse < errors[1].vnmse < errors[2].vnmse
    assert errors[0].top1_agreement >= errors[2].top1_agreement
    # relative MSE ~ noise^2 for white noise
    assert errors[1].relative_mse == pytest.approx(0.01, rel=0.2)


def test_table_round_trip(tmp_path):
    rows = [{"codec": "int4", "streams_used": 1, "vnmse": 0.5},
            {"codec": "lynx", "streams_used": 1, "vnmse": 0.01},
            {"codec": "lynx", "streams_used": 2, "vnmse": 0.0002}]
    path = VNMSETable("t", rows, {"model": "m", "context_tokens": 64}).save(tmp_path / "t.json")
    table = load_vnmse_table(str(path))
    assert table.meta["model"] == "m"
    assert table.lookup("lynx")["vnmse"] == 0.0002
    assert table.lookup("lynx", 1)["vnmse"] == 0.01
    with pytest.raises(ValueError, match="no codec"):
        table.lookup("gear")
    with pytest.raises(ValueError, match="streams_used=3"):
        table.lookup("lynx", 3)
    with pytest.raises(ValueError, match="unknown vNMSE table"):
        load_vnmse_table("no-such-table")
    (tmp_path / "bad.json").write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version"):
        load_vnmse_table(str(tmp_path / "bad.json"))
