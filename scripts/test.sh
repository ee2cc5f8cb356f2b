#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on this machine (no GPU needed;
# tests/test_gpu.py runs only where CUDA is present).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
