"""kvsim: network KV-cache transfer simulator and emulator for disaggregated LLM inference."""

__version__ = "0.1.0"

# Records the data files every run reads (for report provenance) from the first import on.
import kvsim.data_files  # noqa: E402,F401
