"""Encoder-only speed and fidelity of `model.precision` and the compiler's variants, with kernel tables (RESULTS.md sections 5-7).

On the GPU machine, from the repository root:

    PYTHONPATH=. python3 benchmarks/precision.py --photos bench-data [--mixes qwen-mixed siglip]

For each mix of `benchmarks/mixes.py` (distinct JPEGs cut from real photos, the tower of
the published size with random weights saved with `save_pretrained`, the job a user
would write; `benchmarks/scaling.py` builds the same), the rows are decoded and
preprocessed once, then encoded encoder-only (`encoder_only.measure`: compiled blocks,
one graph per budget, the median of `--repeats` CUDA-event-timed passes after a warm-up)
in bf16 and in fp8, each variant's pooled vectors kept. The reference is the same
checkpoint in float32, eager, TF32 off, on the first `--reference` items.

The table, printed again after each mix: images/s, MFU against a bf16 matmul timed in the same process,
the speed-up of fp8; per item, the cosine of fp8 to bf16 (every item), and the cosine
and relative error (|v - ref| / |ref|) of each path to the float32 reference, min or
max and median. `--smoke` runs it all on the CPU with tiny towers and 24 images.
`--kernels` also prints, per mix and precision, the CUDA kernels of one compiled eager
forward of the mix's largest batch by device time (where the time goes).
`--precisions` picks the variants besides bf16 (`VARIANTS`): `fp8` (what a job's
`model.precision: fp8` runs), `fp8-exact-accum` (the FP8 product promoting its partial
sums to float32: `fp8.FAST_ACCUM` off), `fp8-compiler-quant` (activations quantised
by the compiler's fused reduction instead of the Triton row kernel: `fp8.ROW_KERNEL` off),
`fp8-one-block` (the row kernel holding a row in one block of the next power of two, not
up to three: `fp8.ROW_BLOCKS` 1),
`fp8-unjoined` (every linear layer its own quantisation and product: `fp8.JOINT_GROUPS`
empty), `fp8-activation-apart` (the MLP's activation a kernel of its own, not applied by
the layer that reads it: `fp8.ACTIVATION_INTO` empty), `fp8-norm-apart` (the blocks'
norms kernels of their own: `fp8.NORM_INTO` empty) and `fp8-gated-apart` (a gated MLP's
`act(gate) * up` a tensor of its own, written in bf16 and read by the down projection:
`fp8.GATED_MLPS` empty; gate and up still joined), `fp8-keep-out` (the attention output
projection kept in bf16 in every block: `model.fp8_keep`, `ATTENTION_OUTPUT`), `fp8-calibrated` (the FP8
weights calibrated on the mix's first `CALIBRATION_ROWS` items, `model.fp8_calibrate`: with it every
cosine to bf16 is over the other items only, and the float32 reference is always on the last items);
`bf16-patch-conv` and `fp8-patch-conv`
run the fixed-resolution towers' patch embedding as cuDNN's convolution, not one matrix product
(`fixed.PATCH_PRODUCTS` off; SigLIP's hidden state then enters the blocks transposed); `bf16-gelu-apart` leaves SigLIP's tanh
GELU a kernel of its own instead of the product's epilogue (`epilogues.EPILOGUES` off);
`bf16-quick-gelu-apart` leaves CLIP's quick GELU a kernel of its own instead of our Triton
GEMM's epilogue (`epilogues.TRITON_EPILOGUES` off, `encoders.gemm_kernel`);
`bf16-mlp-unpadded` and `fp8-mlp-unpadded` leave the fixed towers' MLP widths as the
checkpoint has them (`fixed.MLP_MULTIPLE` 1: SigLIP-so400m's 4,304, not 4,352);
`bf16-looped-rows` and `fp8-looped-rows` leave torch's rule for reducing wide rows
(`base.WIDE_ROWS` 0: the norms of rows over 1,024 elements loop); `bf16-varlen` runs the
Qwen-VL towers' attention without FlashAttention-4 (`model.attention: varlen`: varlen_attn,
our Triton segment kernel on the 64-patch windows), where `bf16` runs what `auto` picks
(FA4 on the long segments where it is installed); `bf16-varlen-attn` runs torch's
varlen_attn on the windows too (`attention.SEGMENT_MAX_LENGTH` 0), `bf16-segments-all` the
segment kernel on every segment FA4 does not take (`attention.SEGMENT_MAX_LENGTH` past
every length);
`bf16-cd-tuned` and `bf16-autotuned` compile the blocks with inductor's coordinate descent
tuning, and the latter with max_autotune too (`encoder_only.TUNED`: the compiler's own GEMM kernels,
tuned for the largest budget, which is captured first).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.encoder_only import TUNED, EncoderOnly, measure, module_settings, preprocess_rows  # noqa: E402
from benchmarks.common import builtin_sources, collect_photos, cosine, matmul_peak  # noqa: E402
from benchmarks.common import log as _log  # noqa: E402
from benchmarks.mixes import MIXES, jpeg_dataset, save_tower, write_job  # noqa: E402
from embedjob.bench import largest_batch_kernels  # noqa: E402
from embedjob.config import load_job  # noqa: E402
from embedjob.encoders import attention, base, epilogues, fixed, fp8, load_adapter  # noqa: E402
from embedjob.engine.encode import budget_plan  # noqa: E402

SMOKE_IMAGES = 24
DEFAULT_IMAGES = {"qwen-mixed": 768, "qwen-224": 2048, "siglip": 2048, "clip": 2048}
REFERENCE = ["model.dtype=float32", "batching.compile=false", "batching.cuda_graphs=false"]
VARIANTS = {
    "bf16": ("bf16", {}),
    "bf16-patch-conv": ("bf16", {(fixed, "PATCH_PRODUCTS"): False}),
    "bf16-looped-rows": ("bf16", {(base, "WIDE_ROWS"): 0}),
    "bf16-mlp-unpadded": ("bf16", {(fixed, "MLP_MULTIPLE"): 1}),
    "bf16-gelu-apart": ("bf16", {(epilogues, "EPILOGUES"): False}),
    "bf16-quick-gelu-apart": ("bf16", {(epilogues, "TRITON_EPILOGUES"): False}),
    "bf16-varlen": ("bf16", {}, ["model.attention=varlen"]),
    "bf16-varlen-attn": ("bf16", {(attention, "SEGMENT_MAX_LENGTH"): 0}),
    "bf16-segments-all": ("bf16", {(attention, "SEGMENT_MAX_LENGTH"): 1 << 30}),
    **{f"bf16-{name}": ("bf16", {(base, "COMPILE_OPTIONS"): options}) for name, options in TUNED.items()},
    "fp8": ("fp8", {}),
    "fp8-exact-accum": ("fp8", {(fp8, "FAST_ACCUM"): False}),
    "fp8-compiler-quant": ("fp8", {(fp8, "ROW_KERNEL"): False}),
    "fp8-one-block": ("fp8", {(fp8, "ROW_BLOCKS"): 1}),
    "fp8-unjoined": ("fp8", {(fp8, "JOINT_GROUPS"): ()}),
    "fp8-activation-apart": ("fp8", {(fp8, "ACTIVATION_INTO"): ()}),
    "fp8-norm-apart": ("fp8", {(fp8, "NORM_INTO"): ()}),
    "fp8-patch-conv": ("fp8", {(fixed, "PATCH_PRODUCTS"): False}),
    "fp8-gated-apart": ("fp8", {(fp8, "GATED_MLPS"): ()}),
    "fp8-looped-rows": ("fp8", {(base, "WIDE_ROWS"): 0}),
    "fp8-mlp-unpadded": ("fp8", {(fixed, "MLP_MULTIPLE"): 1}),
    "fp8-keep-out": ("fp8", {}, lambda family, _smoke: [f"model.fp8_keep=[{ATTENTION_OUTPUT[family]}]"]),
    "fp8-calibrated": ("fp8", {}, lambda _family, smoke: [f"model.fp8_calibrate={calibration_rows(smoke)}"]),
}
"""Variant -> (model.precision, the (module, setting) pairs of `encoders.fp8`,
`encoders.fixed`, `encoders.base` and `encoders.epilogues` it changes while its adapter is
made, with their values[, further job overrides, or a function of the tower's family
and --smoke that gives them])."""
ATTENTION_OUTPUT = {"qwen2_5_vl": "attn.proj", "siglip": "self_attn.out_proj", "clip": "self_attn.out_proj"}
"""The mixes' towers' attention output projection, by family: what `fp8-keep-out` keeps in bf16."""
CALIBRATION_ROWS = 64
"""The items `fp8-calibrated` calibrates on: the mix's first (`model.fp8_calibrate`); 8 with --smoke."""


def calibration_rows(smoke: bool) -> int:
    return 8 if smoke else CALIBRATION_ROWS


def log(message: str) -> None:
    """Progress on stderr."""
    _log("precision", message)


def fresh_compiles() -> None:
    """Every variant compiles its own kernels: settings that change the compiler's choices
    (`base.WIDE_ROWS`) are not part of its cache key, so a cached graph of one variant
    would otherwise serve the next."""
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def layers_of(name: str, family: str, smoke: bool):
    """The overrides of variant `name` for a tower of `family`, with its module settings in force while inside."""
    precision, settings, *extra = VARIANTS[name]
    overrides = (extra[0](family, smoke) if callable(extra[0]) else extra[0]) if extra else []
    with module_settings(settings):
        yield [f"model.precision={precision}", *overrides]


def variant(job_path: Path, overrides: list[str], device: torch.device, prepared, repeats: int) -> tuple[EncoderOnly, np.ndarray]:
    """One precision of the mix's job on the prepared items: its timing and pooled vectors."""
    outputs: list[torch.Tensor] = []
    result = measure(load_job(job_path, overrides), device, 1, repeats, prepared, outputs)
    free(device)
    return result, torch.cat(outputs).numpy()


def kernel_table(job_path: Path, name: str, family: str, device: torch.device, items: list, rows: int = 15) -> str:
    """The CUDA kernels of one compiled eager forward of the largest packed batch of
    `items` in variant `name`, by total device time (`bench.largest_batch_kernels`)."""
    with layers_of(name, family, False) as overrides:
        job = load_job(job_path, overrides)
        adapter = load_adapter(job, device)
        adapter.compile(dynamic=True)
        batch, table = largest_batch_kernels(adapter, items, budget_plan(job, adapter), job.batching.policy, rows)
    del adapter
    free(device)
    return f"{name}, one batch of {batch.tokens} tokens ({len(batch.indices)} items):\n{table}"


def relative_error(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)


def bench_mix(name: str, args: argparse.Namespace, photos, device: torch.device, peak: float | None) -> dict:
    mix = MIXES[name]
    count = SMOKE_IMAGES if args.smoke else args.images.get(name, DEFAULT_IMAGES[name])
    workdir = Path(args.workdir).resolve()
    dataset = jpeg_dataset(mix, count, args.seed, photos, workdir / "data", len(os.sched_getaffinity(0)))
    tower = save_tower(mix.tower, workdir / "towers", args.smoke)
    job_path = write_job(workdir / name, mix, tower, dataset.path, workdir / "cache", args.smoke)
    base = load_job(job_path)
    adapter = load_adapter(base, device)
    prepared = preprocess_rows(base, adapter, len(os.sched_getaffinity(0)))
    del adapter
    free(device)
    log(f"[{name}] {len(prepared[0])} items ({prepared[1]} did not decode)")
    results, vectors = {}, {}
    for precision in args.precisions:
        log(f"[{name}] {precision}")
        with layers_of(precision, mix.tower.family, args.smoke) as overrides:
            results[precision], vectors[precision] = variant(job_path, overrides, device, prepared, args.repeats)
    reference_items = (prepared[0][-args.reference :], 0)
    log(f"[{name}] float32 reference on the last {len(reference_items[0])} items")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    _, reference = variant(job_path, REFERENCE, device, reference_items, 1)
    n = len(reference)
    # Cosines to bf16 leave out the items a calibrated variant calibrated on, for every variant alike.
    held = calibration_rows(args.smoke) if "fp8-calibrated" in args.precisions else 0
    if args.kernels and device.type == "cuda":
        for precision in args.precisions:
            log(f"[{name}] kernels, {precision}:\n" + kernel_table(job_path, precision, mix.tower.family, device, prepared[0]))
    return {
        "mix": name,
        "items": len(prepared[0]),
        "tower": mix.tower.describe(args.smoke),
        "results": results,
        "to_bf16": {p: cosine(vectors[p][held:], vectors["bf16"][held:]) for p in results if p != "bf16"},
        "to_reference": {p: (cosine(vectors[p][-n:], reference), relative_error(vectors[p][-n:], reference)) for p in results},
        "reference_items": n,
        "held": held,
        "peak": peak,
    }


def ratio(error: float, bf16_error: float) -> str:
    """`error` over bf16's as "N.NNx", or "-" where bf16's is zero (on the CPU, --smoke,
    the bf16 path computes in float32 and equals the reference)."""
    return f"{error / bf16_error:.2f}x" if bf16_error > 0 else "-"


def render(rows: list[dict], args: argparse.Namespace, wall: float) -> str:
    peak = rows[0]["peak"] if rows else None
    lines = [
        f"# model.precision: bf16 against fp8, encoder only — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- command: `{' '.join(sys.argv)}` ({wall / 60:.1f} min)",
        f"- device: {torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else 'cpu'}; "
        f"torch {torch.__version__}; bf16 matmul {peak / 1e12:.0f} TFLOP/s" if peak else "- device: cpu (--smoke)",
        f"- passes: median of {args.repeats} after a warm-up (CUDA events); reference: float32, eager, TF32 off",
        "",
        "| mix | precision | items | seconds | images/s | MFU | speed-up | cos to bf16 min / median "
        "| cos to fp32 min / median | rel. err to fp32 median / max |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for row in rows:
        bf16 = row["results"]["bf16"]
        for precision, result in row["results"].items():
            cos_ref, err = row["to_reference"][precision]
            mfu = f"{100 * result.flops / result.seconds / peak:.1f}%" if peak else "-"
            to_bf16 = row["to_bf16"].get(precision)
            lines.append(
                f"| {row['mix']} | {precision} | {result.items} | {result.seconds:.3f} | {result.rate:.1f} | {mfu} "
                f"| {bf16.seconds / result.seconds:.2f}x "
                f"| {'-' if to_bf16 is None else f'{to_bf16.min():.5f} / {np.median(to_bf16):.5f}'} "
                f"| {cos_ref.min():.5f} / {np.median(cos_ref):.5f} | {np.median(err):.2e} / {err.max():.2e} |"
            )
    lines.append("")
    for row in rows:
        _, err_bf16 = row["to_reference"]["bf16"]
        ratios = "; ".join(
            f"{p}'s error to float32 over bf16's: median {ratio(np.median(err), np.median(err_bf16))}, "
            f"max {ratio(err.max(), err_bf16.max())}"
            for p, (_, err) in row["to_reference"].items()
            if p != "bf16"
        )
        held = f", cosines to bf16 over the {row['items'] - row['held']} after the first {row['held']}" if row["held"] else ""
        lines.append(
            f"- **{row['mix']}**: {row['tower']}; {row['items']} items{held}, float32 reference on the last "
            f"{row['reference_items']}; {ratios}"
        )
    return "\n".join(lines)


def parse_images(values: list[str]) -> dict[str, int]:
    counts = {}
    for value in values:
        name, _, number = value.partition("=")
        if name not in MIXES or not number.isdigit():
            raise SystemExit(f"--images: expected NAME=COUNT with NAME one of {', '.join(MIXES)}, got {value!r}")
        counts[name] = int(number)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", nargs="+", type=Path, default=[])
    parser.add_argument("--mixes", nargs="+", default=["qwen-mixed", "siglip"], choices=list(MIXES))
    parser.add_argument("--images", nargs="+", default=[], metavar="NAME=COUNT")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference", type=int, default=64, help="items encoded by the float32 reference")
    parser.add_argument("--workdir", default="precision-work")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny towers, 24 images per mix, no compile")
    parser.add_argument("--kernels", action="store_true", help="also the kernel table of one batch per precision (GPU)")
    parser.add_argument("--precisions", nargs="+", default=["fp8"], choices=[p for p in VARIANTS if p != "bf16"])
    args = parser.parse_args()
    args.precisions = ["bf16", *dict.fromkeys(args.precisions)]
    args.images = parse_images(args.images)
    started = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    fresh_compiles()
    photos = collect_photos([*builtin_sources(), *args.photos])
    peak = None
    if not args.smoke:
        peak = matmul_peak(device, "precision")
        free(device)
    rows = []
    for name in args.mixes:  # the table so far after each mix: a run cut short keeps what it measured
        rows.append(bench_mix(name, args, photos, device, peak))
        print(render(rows, args, time.perf_counter() - started), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
