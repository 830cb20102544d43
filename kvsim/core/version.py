"""kvsim's version: the package's (pyproject.toml reads it from here), the reports' and
`kvsim --version`'s."""

VERSION = "0.1.0"
