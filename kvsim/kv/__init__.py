"""KV caches to work on: synthetic ones with real structure, a real model's prefill captures
(live or on disk), reproducible text to prefill, speculative decoding on a partial cache with
the real model, and attention error of a compressed cache."""
