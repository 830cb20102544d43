#!/usr/bin/env bash
# Install PyTorch only where none is importable. On a GPU machine the existing CUDA build
# (seen: torch 2.11 + triton 3.6) is kept; on a CPU-only machine the CPU build is taken
# (torch==2.13.0 is served locally here), never the multi-GB CUDA wheel set.
set -euo pipefail
PY=${PY:-python3}
PIP=${PIP:-"$PY -m pip"}
if $PY -c "import torch" 2>/dev/null; then
  echo "torch $($PY -c 'import torch; print(torch.__version__)') already installed; keeping it"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $PIP install -q torch
else
  $PIP install -q "torch==2.13.0"
fi
