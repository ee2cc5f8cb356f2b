"""A CUDA stream whose kernels run on part of the GPU's SMs (a green context), so that
work queued on other streams finds SMs of its own.

A kernel that holds every SM (a persistent GEMM, one wave of attention) keeps any other
stream's kernel, and the device-to-device copies too, waiting until its last block ends:
beside bf16 products on another stream, a 1080p frame's copy took 0.32 ms (one product)
instead of 0.02, by `Tensor.copy_` or the driver's copies alike, at any stream priority
(CUDA's 8 hardware queues; `benchmarks/copy_wait.py`, benchmarks/RESULTS.md section 11). torch's SM carveout reaches
only cuBLAS; a green context holds every kernel queued on its streams, graphs' included,
to its SMs. The driver's API is called through ctypes (CUDA 12.5 or later), as torch's
own wrapper needs the `cuda-python` bindings.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

_SM_RESOURCE = 1
"""CU_DEV_RESOURCE_TYPE_SM."""

_RESOURCE_BYTES = 1024
"""Room for one CUdevResource: 144 bytes in CUDA 12's header, which later ones may grow."""

_SM_COUNT_AT = 96
"""Where CUdevResource's `sm.smCount` lies: after its type and 92 bytes of padding."""

_GREEN_DEFAULT_STREAM = 1
"""CU_GREEN_CTX_DEFAULT_STREAM, which cuGreenCtxCreate requires."""

_NON_BLOCKING = 1
"""CU_STREAM_NON_BLOCKING: the stream does not wait for the legacy default stream."""


@dataclass(frozen=True)
class GreenStream:
    """A stream of a green context on `device` whose kernels run on `sms` of its `total`
    SMs. The context is never destroyed: graphs captured on its stream outlive any one
    caller, so it lives as long as the process."""

    stream: torch.cuda.ExternalStream
    sms: int
    total: int


class GreenUnavailable(RuntimeError):
    """The driver makes no green context here (older than CUDA 12.5, or refuses the split)."""


def green_stream(device: torch.device, free: int) -> GreenStream:
    """A stream whose kernels leave at least `free` of `device`'s SMs to other streams
    (the driver partitions SMs in groups, 8 on Hopper, so it may leave a few more).
    Raises `GreenUnavailable` where the driver cannot."""
    return _made(device.index if device.index is not None else torch.cuda.current_device(), free)


@functools.cache
def _made(index: int, free: int) -> GreenStream:
    """One green stream per device and count of SMs left free: the contexts are few and
    kept (each holds driver resources)."""
    driver = _driver()
    torch.cuda.init()
    device = ctypes.c_int()
    _check(driver, "cuDeviceGet", ctypes.byref(device), index)
    whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
    _check(driver, "cuDeviceGetDevResource", device, whole, _SM_RESOURCE)
    total = _sm_count(whole)
    if not 0 < free < total:
        raise GreenUnavailable(f"cannot leave {free} of the device's {total} SMs free")
    part = _split(driver, whole, total - free)
    sms = _sm_count(part)
    desc, context, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    _check(driver, "cuDevResourceGenerateDesc", ctypes.byref(desc), part, 1)
    _check(driver, "cuGreenCtxCreate", ctypes.byref(context), desc, device, _GREEN_DEFAULT_STREAM)
    _check(driver, "cuGreenCtxStreamCreate", ctypes.byref(stream), context, _NON_BLOCKING, 0)
    return GreenStream(torch.cuda.ExternalStream(stream.value, device=torch.device("cuda", index)), sms, total)


def _split(driver: ctypes.CDLL, whole: ctypes.Array, most: int) -> ctypes.Array:
    """One group of at most `most` SMs split from `whole`. The driver rounds a group up to
    its granularity (8 SMs on Hopper), so the count asked steps down until one fits."""
    split = _function(driver, "cuDevSmResourceSplitByCount")
    status = 0
    for asked in range(most, 0, -1):
        part, rest = ctypes.create_string_buffer(_RESOURCE_BYTES), ctypes.create_string_buffer(_RESOURCE_BYTES)
        groups = ctypes.c_uint(1)
        status = split(part, ctypes.byref(groups), whole, rest, 0, asked)
        if not status and groups.value == 1 and 0 < _sm_count(part) <= most:
            return part
    raise GreenUnavailable(f"the driver split no group of at most {most} SMs (last CUDA error {status})")


def _sm_count(resource: ctypes.Array) -> int:
    return int.from_bytes(resource.raw[_SM_COUNT_AT : _SM_COUNT_AT + 4], "little")


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise GreenUnavailable(f"no CUDA driver library: {exc}") from exc


def _function(driver: ctypes.CDLL, call: str) -> ctypes._CFuncPtr:
    function = getattr(driver, call, None)
    if function is None:
        raise GreenUnavailable(f"the CUDA driver has no {call} (green contexts need CUDA 12.5 or later)")
    return function


def _check(driver: ctypes.CDLL, call: str, *args: object) -> None:
    status = _function(driver, call)(*args)
    if status:
        raise GreenUnavailable(f"{call} returned CUDA error {status}")
