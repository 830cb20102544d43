"""Real language models: presets (conf/llm/), fetching weights, offline loading."""

from kvsim.model.fetch import FetchResult, cache_dir, cached_gguf_path, fetch_model
from kvsim.model.load import LoadedLM, load_lm, locate_weights
from kvsim.model.presets import LLMPreset, llm_preset_names, load_llm_preset

__all__ = ["FetchResult", "LLMPreset", "LoadedLM", "cache_dir", "cached_gguf_path",
           "fetch_model", "llm_preset_names", "load_llm_preset", "load_lm", "locate_weights"]
