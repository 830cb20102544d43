"""A tiny randomly initialised Llama and a byte-level tokenizer: the whole quality pipeline in
seconds, with no weights (tests, and `kvsim quality model=tiny-random` as a dry run, see
conf/model/tiny-random.yaml).

Numbers measured on it say nothing about real models; only that the machinery works.
"""

from __future__ import annotations

from typing import Any

import torch

TINY_NAME = "tiny-random"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (vocabulary 256); `encode` / `decode` like HF's."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def tiny_llama(seed: int = 0, layers: int = 3, hidden: int = 64, q_heads: int = 4,
               kv_heads: int = 2, vocab: int = 256) -> Any:
    """Random LlamaForCausalLM (float32, eval, sdpa attention), GQA with q_heads/kv_heads.

    The random init is scaled up (std 0.1) so logits are peaked enough that greedy decoding
    is not a coin toss between near-equal tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=q_heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         rope_theta=10000.0, initializer_range=0.1, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model
