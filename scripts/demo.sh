#!/usr/bin/env bash
# Set up (if needed) and run the demo job: real photos and two broken rows, embedded by a
# tiny Qwen2.5-VL vision tower with fixed-seed random weights. Output: out/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/embedjob run jobs/demo.yaml "$@"
