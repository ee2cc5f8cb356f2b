"""Encoder adapters, one module per family; `load_adapter` picks by `model.family`."""

from __future__ import annotations

import torch

from embedjob.config import Job
from embedjob.encoders.base import EncoderAdapter, EncoderInput, StaticInputs, resolve_dtype

__all__ = ["EncoderAdapter", "EncoderInput", "StaticInputs", "load_adapter"]

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FIXED_FAMILIES = ("clip", "siglip", "dinov2")


def load_adapter(job: Job, device: torch.device) -> EncoderAdapter:
    """Build the adapter the job asks for, on `device`, in the job's dtype (float32 on CPU)."""
    dtype = resolve_dtype(job.model.dtype, device)
    options = {
        "cache_dir": job.runtime.cache_dir,
        "min_pixels": job.preprocess.min_pixels,
        "max_pixels": job.preprocess.max_pixels,
        "video_min_pixels": job.video.min_pixels,
        "video_max_pixels": job.video.max_pixels,
        "video_max_frames": job.video.max_frames,
        "tiling": job.preprocess.tiling,
        "max_tiles": job.preprocess.max_tiles,
        "tile_combine": job.preprocess.tile_combine,
        "dinov2_pool": job.model.dinov2_pool,
        "per_token": job.output.pooling == "none",
    }
    if job.model.family in QWEN_FAMILIES:
        from embedjob.encoders.qwen import build_adapter

        return build_adapter(job.model.family, job.model.path, dtype, device, options)
    if job.model.family in FIXED_FAMILIES:
        from embedjob.encoders.fixed import build_adapter as build_fixed

        return build_fixed(job.model.family, job.model.path, dtype, device, options)
    raise ValueError(f"model.family {job.model.family!r} has no adapter yet")
