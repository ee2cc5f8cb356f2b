"""Shared fixtures: tiny builtin encoders made once per session in a private cache."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedjob.config import Job, job_from_dict
from embedjob.encoders import load_adapter

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's own home and Ray state directory (RAY_TMPDIR), without the user's
    Ray settings: nothing the suite starts reads or writes the user's ~/.ray or
    /tmp/ray. A token that a local Ray job had left in ~/.ray/auth_token turned token
    authentication on for the cluster a test started, and its drivers, which did not
    send that token, could not connect."""
    home = tmp_path_factory.mktemp("home")
    # Short: Ray's socket paths under it must stay within the 107 bytes a Unix socket allows.
    ray_state = tempfile.mkdtemp(prefix="embedjob-ray-", dir="/tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.setenv("RAY_TMPDIR", ray_state)
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            patch.delenv(name, raising=False)
        yield home
    shutil.rmtree(ray_state, ignore_errors=True)


S3_BUCKET = "embedjob-test"
"""The bucket `endpoint` makes, which the object-storage tests write under."""


@pytest.fixture(scope="session")
def endpoint() -> Iterator[str]:
    """moto's S3 on 127.0.0.1 (a free port) with the bucket S3_BUCKET, and this
    process's AWS settings pointing at it for the rest of the session (subprocesses
    inherit them). One server for the session: fsspec keeps one S3 file system per set
    of arguments, and one made for a server stopped at a module's end would be handed to
    the next module's tests."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    settings = {
        "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in settings.items():
            patch.setenv(name, value)
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(S3_BUCKET)
        yield url
    server.stop()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One model cache for the whole session, so each builtin tower is built once."""
    return str(tmp_path_factory.mktemp("embedjob-cache"))


def make_job(cache_dir: str, **sections: dict) -> Job:
    raw: dict = {
        "input": {"path": "unused.parquet", "media_column": "image"},
        "model": {"path": "builtin:tiny-qwen2_5_vl"},
        "output": {"path": "unused"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    raw.setdefault("runtime", {})["cache_dir"] = cache_dir
    return job_from_dict(raw)


@pytest.fixture(scope="session")
def qwen_adapter(cache_dir: str):
    """The builtin tiny Qwen2.5-VL tower on the CPU (float32)."""
    return load_adapter(make_job(cache_dir), torch.device("cpu"))


def random_image(height: int, width: int, seed: int = 0) -> SimpleNamespace:
    """A decoded image as the decode stage hands it over: (H, W, 3) uint8."""
    rng = np.random.default_rng(seed)
    return SimpleNamespace(pixels=rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def random_video(frames: int, height: int, width: int, seed: int = 0) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    return SimpleNamespace(frames=rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8))
