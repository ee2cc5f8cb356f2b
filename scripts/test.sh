#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on this machine (no GPU needed;
# tests/test_gpu.py runs only where CUDA is present).
#
# As root with apt (CI: .ci/run), a single-node SLURM is brought up first for
# tests/test_slurm.py (scripts/slurm-up.sh, ~5 s) and stopped afterwards; elsewhere, or
# with EMBEDJOB_TEST_SLURM=0, those tests are skipped. A cluster that already answers
# is used as it is and left running.
#
# Likewise Debian's Chromium is installed (once) for the browser test of
# tests/test_report.py, which renders a report headless; elsewhere, or with
# EMBEDJOB_TEST_BROWSER=0, that test is skipped.
#
# `scripts/test.sh --quick` runs the unit tests alone (pytest -m "not slow": no test that
# starts a scheduler, a browser, Ray or many job processes), a few minutes on 2 cores;
# it brings up nothing. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${1:-}" = --quick ]; then
  shift
  exec .venv/bin/python -m pytest -q -m "not slow" "$@"
fi
has_browser() { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }
install_browser() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=300 chromium >/dev/null; }
if [ "${EMBEDJOB_TEST_BROWSER:-1}" != 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! has_browser; then
  if ! install_browser 2>/dev/null && ! { apt-get update -q >/dev/null && install_browser; }; then
    echo "test.sh: Chromium could not be installed; tests/test_report.py will skip its browser test" >&2
  fi
fi
slurm_up() { timeout 10 scontrol ping 2>/dev/null | grep -q "is UP"; }
if [ "${EMBEDJOB_TEST_SLURM:-1}" != 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! slurm_up; then
  if scripts/slurm-up.sh; then
    trap 'scripts/slurm-down.sh' EXIT
  else
    echo "test.sh: SLURM could not be brought up; tests/test_slurm.py will skip its cluster test" >&2
  fi
fi
.venv/bin/python -m pytest -q "$@"
