"""kvsim: network KV-cache transfer simulator and emulator for disaggregated LLM inference."""

__version__ = "0.1.0"
