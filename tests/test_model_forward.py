"""kvsim.model.forward: the cache argument by the name the installed transformers takes."""

from __future__ import annotations

import warnings

import pytest

from kvsim.model.forward import cache_argument, lm_forward


class OldStyle:
    def forward(self, input_ids=None, past_key_values=None, use_cache=False, **kwargs):
        return ("past_key_values", input_ids, past_key_values, use_cache, kwargs)

    __call__ = forward


class NewStyle:
    def forward(self, input_ids=None, cache=None, use_cache=False, **kwargs):
        return ("cache", input_ids, cache, use_cache, kwargs)

    __call__ = forward


@pytest.mark.parametrize("cls", [OldStyle, NewStyle])
def test_the_cache_goes_by_the_name_the_forward_takes(cls):
    name, ids, cache, use_cache, kwargs = lm_forward(cls(), [1], "C", logits_to_keep=1)
    assert name == cache_argument(cls) and (ids, cache, use_cache) == ([1], "C", True)
    assert kwargs == {"logits_to_keep": 1}


def test_a_real_model_forward_takes_its_cache_without_a_deprecation_warning():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import DynamicCache

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    cache = DynamicCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            lm_forward(model, torch.tensor([[1, 2, 3]]), cache)
            out = lm_forward(model, torch.tensor([[4]]), cache)
    assert out.logits.shape == (1, 1, 32) and cache.get_seq_length() == 4
