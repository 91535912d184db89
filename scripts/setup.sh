#!/usr/bin/env bash
# Set up draftsmith on a fresh machine: a virtual environment at .venv with the project installed editable.
#     ./scripts/setup.sh
# torch is installed first and pinned (2.13.0, the CPU build on local disk) so no resolver pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
.venv/bin/python -c "import torch, draftsmith.decode, draftsmith.pairing, draftsmith.distill, draftsmith.recipes; print('draftsmith ready: torch', torch.__version__)"
