"""Speculative draft/verify: greedy losslessness, sampling acceptance rule, survival curves."""

from __future__ import annotations

import pytest
import torch

from kvsim.kv.capture import cache_to_kv, prefill
from kvsim.kv.draft_verify import (
    accept_greedy,
    accept_sampled,
    decode,
    speculative_round,
    survival_curve,
)
from kvsim.model.tiny import tiny_llama


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = tiny_llama(seed=1)
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(2))
    cache, last = prefill(model, ids)
    return model, cache_to_kv(cache), int(last.argmax())


def test_greedy_is_lossless(setup):
    """Whatever the draft cache, the emitted tokens are exactly target-only greedy decoding."""
    model, kv, first = setup
    n = 12
    target_only, _ = decode(model, kv, first, n + 1)
    accepted_counts = []
    for noise in (0.0, 0.05, 0.3, 3.0):
        gen = torch.Generator().manual_seed(7)
        kv_draft = kv + noise * kv.std() * torch.randn(kv.shape, generator=gen)
        rnd = speculative_round(model, kv_draft, kv, first, n, "greedy")
        assert rnd.proposed == n and len(rnd.draft) == n
        assert len(rnd.emitted) == rnd.accepted + 1
        assert rnd.emitted == target_only[: len(rnd.emitted)]
        assert rnd.draft[: rnd.accepted] == target_only[: rnd.accepted]
        accepted_counts.append(rnd.accepted)
    assert accepted_counts[0] == n  # same cache: every draft token survives (+ bonus token)
    assert min(accepted_counts) < n  # a bad draft cache is corrected at its first divergence


def test_accept_greedy_prefix():
    assert accept_greedy([1, 2, 3], [1, 2, 9, 4]) == (2, [1, 2, 9])
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == (3, [1, 2, 3, 4])
    assert accept_greedy([5], [1, 0]) == (0, [1])
    with pytest.raises(ValueError, match="one more"):
        accept_greedy([1, 2], [1, 2])


def test_sampling_acceptance_preserves_target_distribution():
    """First emitted token of speculative sampling ~ p, whatever q (Leviathan et al.)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    trials = 6000
    counts = torch.zeros(4)
    accepted_total = 0
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=gen))
        acc, emitted = accept_sampled([d], [q], [p, p], gen)
        counts[emitted[0]] += 1
        accepted_total += acc
    freq = counts / trials
    assert torch.allclose(freq, p.float(), atol=0.03), freq
    # acceptance probability = sum_x min(p, q) = 0.1 + 0.2 + 0.15 + 0.05 = 0.5
    assert abs(accepted_total / trials - 0.5) < 0.03


def test_sampling_round_runs_on_model(setup):
    model, kv, first = setup
    same = speculative_round(model, kv, kv, first, 6, "sampling", temperature=1.0, seed=3)
    assert same.accepted == 6  # p == q: every ratio is 1
    noisy = kv + 3.0 * kv.std() * torch.randn(kv.shape, generator=torch.Generator().manual_seed(1))
    rnd = speculative_round(model, noisy, kv, first, 6, "sampling", seed=3)
    assert 0 <= rnd.accepted <= 6 and len(rnd.emitted) == rnd.accepted + 1


def test_survival_curve():
    assert survival_curve([0, 2, 4, 4], 4) == [1.0, 0.75, 0.75, 0.5, 0.5]
    with pytest.raises(ValueError):
        survival_curve([], 4)


def test_bad_arguments(setup):
    model, kv, first = setup
    with pytest.raises(ValueError, match="decoding"):
        speculative_round(model, kv, kv, first, 4, "beam")
    with pytest.raises(ValueError, match="differ in shape"):
        speculative_round(model, kv[:, :, :, :-1], kv, first, 4)
    with pytest.raises(ValueError, match="n_draft"):
        speculative_round(model, kv, kv, first, 0)
