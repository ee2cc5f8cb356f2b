#!/usr/bin/env bash
# Creates .venv (once) and installs embedjob with its test tools and Ray (the tests run
# `--engine ray` on a local Ray cluster) into it, with open_clip_torch and faiss-cpu (the
# open_clip and index extras: their tests run too), and s3fs with moto's S3 server (s3test:
# the object-storage tests run against it on 127.0.0.1).
# torch 2.14.1 / torchvision 0.29.1 are the newest releases these machines carry locally;
# on other machines pip downloads them.
# An install records what it installed from (.venv/.embedjob-setup: a hash of this
# script and pyproject.toml), so that later runs of the demo and the tests skip pip
# (several seconds) until one of the two changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.embedjob-setup
wanted=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/embedjob ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
.venv/bin/python -m pip install -q -e '.[test,ray,open_clip,index,s3test]'
echo "$wanted" > "$stamp"
