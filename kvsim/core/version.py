"""kvsim's version (the one in pyproject.toml), for reports and `kvsim --version`."""

VERSION = "0.1.0"
