"""Real language models: presets by name (conf/model/), fetching weights, offline loading."""

from kvsim.model.fetch import FetchResult, cache_dir, cached_gguf_path, fetch_model
from kvsim.model.load import LoadedLM, load_lm, locate_weights
from kvsim.model.presets import load_model_preset, model_preset_names

__all__ = ["FetchResult", "LoadedLM", "cache_dir", "cached_gguf_path", "fetch_model",
           "load_lm", "load_model_preset", "locate_weights", "model_preset_names"]
