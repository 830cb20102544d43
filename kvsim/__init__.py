"""kvsim: network KV-cache transfer simulator and emulator for disaggregated LLM inference."""

# Records the data files every run reads (for report provenance) from the first import on.
import kvsim.core.data_files  # noqa: F401
from kvsim.core.version import VERSION as __version__  # noqa: F401
