"""One forward of a causal LM on its cache, whatever the installed transformers calls the
cache argument: `past_key_values` (transformers 4.x and early 5.x) or `cache` (the name it
takes from 5.24 on, where the old one warns and is to go in 5.40)."""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def cache_argument(model_class: type) -> str:
    """The name `model_class.forward` takes its cache by."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def lm_forward(model: Any, input_ids: Any, cache: Any, **kwargs: Any) -> Any:
    """model(input_ids=input_ids, <cache argument>=cache, use_cache=True, **kwargs): the
    model's output, the cache grown by the fed tokens."""
    return model(input_ids=input_ids, use_cache=True,
                 **{cache_argument(type(model)): cache}, **kwargs)
