"""Model presets: the architecture numbers the simulator needs (conf/model/<name>.yaml).

KV cache size (the seeds' Eq. 1): size_bytes = K_factor * tokens * D * layers * precision,
with D = kv_heads * head_dim for GQA/MHA (K_factor 2: keys and values) and D = the
latent width for MLA (K_factor 1: one compressed latent per token per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from kvsim.config.checks import check_number
from kvsim.layout import KVShape

ATTENTION_KINDS = ("gqa", "mha", "mla")


@dataclass
class ModelSpec:
    name: str = MISSING
    layers: int = MISSING
    attention_heads: int = MISSING  # query heads
    kv_heads: int = MISSING  # GQA KV heads (MLA: 1, the shared latent)
    head_dim: int = MISSING  # per-head width of attention (used for attention FLOPs)
    hidden_size: int = MISSING
    params_total: float = MISSING  # parameter count (all experts)
    params_active: float = MISSING  # parameters touched per token (MoE: active experts)
    attention: str = "gqa"  # gqa | mha | mla
    kv_latent_dim: int = 0  # MLA only: cached elements per token per layer (rank + rope dims)
    weight_bytes_per_param: float = 2.0  # bf16 weights

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"model {self.name}: attention must be one of {ATTENTION_KINDS}, "
                             f"got {self.attention!r}")
        for key in ("layers", "attention_heads", "kv_heads", "head_dim", "hidden_size"):
            value = getattr(self, key)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"model {self.name}: {key} must be >= 1, got {value}")
        if self.attention == "mla" and (self.kv_latent_dim < 2 or self.kv_latent_dim % 2):
            raise ValueError(f"model {self.name}: MLA needs an even kv_latent_dim >= 2, "
                             f"got {self.kv_latent_dim}")
        for key in ("params_total", "params_active", "weight_bytes_per_param"):
            value = getattr(self, key)
            if isinstance(value, (int, float)):
                check_number(f"model {self.name}: {key}", value)
        if not 0 < self.params_active <= self.params_total:
            raise ValueError(f"model {self.name}: need 0 < params_active <= params_total")

    @property
    def kv_factor(self) -> int:
        return 1 if self.attention == "mla" else 2

    @property
    def kv_width(self) -> int:
        """D of Eq. 1: cached elements per token per layer per K/V (MLA: the latent)."""
        return self.kv_latent_dim if self.attention == "mla" else self.kv_heads * self.head_dim

    def kv_bytes_bf16(self, tokens: int) -> int:
        """Eq. 1 in bf16 (2 bytes)."""
        return self.kv_factor * tokens * self.kv_width * self.layers * 2

    def kv_shape(self, tokens: int) -> KVShape:
        """The codec-facing shape [layers, 2, kv_heads, tokens, head_dim].

        MLA has one latent of width W per token per layer; it is laid out as kv_heads = 1,
        head_dim = W / 2 on the (K, V) axis so that element counts (and bytes) match Eq. 1
        with K_factor 1."""
        if self.attention == "mla":
            return KVShape(self.layers, 1, int(tokens), self.kv_latent_dim // 2)
        return KVShape(self.layers, self.kv_heads, int(tokens), self.head_dim)

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.weight_bytes_per_param

    def weight_read_bytes(self, batch: int) -> float:
        """Weights streamed from HBM by one decode step of `batch` sequences: a dense model
        reads all of them; an MoE reads about the active experts per sequence, at most all."""
        return min(self.params_total, self.params_active * max(1, batch)) * \
            self.weight_bytes_per_param

    def forward_flops(self, new_tokens: int, context_tokens: int, causal: bool = True) -> float:
        """FLOPs of a forward pass over `new_tokens` attending to `context_tokens` earlier
        tokens: 2 * active params per token (matmuls) + attention (QK^T and PV, 2 FLOPs per
        multiply-add each): 4 * heads * head_dim per (query, key) pair per layer."""
        n, c = float(new_tokens), float(context_tokens)
        pairs = n * c + (n * (n + 1) / 2 if causal else n * n)
        return 2.0 * self.params_active * n + \
            4.0 * self.layers * self.attention_heads * self.head_dim * pairs


def model_from_dict(doc: dict) -> ModelSpec:
    return ModelSpec(**doc)
