"""Fixed-resolution towers (SigLIP, CLIP) against plain transformers with torch.compile, batch 256 (RESULTS.md section 7).

Usage (from the repository root, on a CUDA machine; --smoke checks the script on the CPU):

    python3 benchmarks/fixed_compile.py [--repeats 20] [--out FILE] [--models siglip clip] [--batch 256]

Builds SigLIP-so400m-patch14-384 and CLIP-L/14-336 vision towers of the published sizes
with random bf16 weights (fixed seed), saves each with its image processor config as a
checkpoint, and times, in one process on one GPU, one batch of `--batch` random uint8
images already on the device, each variant its own row:

  plain_eager                 transformers' model from the checkpoint, eager: the reference
                              every row's embeddings are compared with (min cosine over the batch)
  plain_compile               torch.compile(model), default mode: what a user writes
  plain_compile_graphs        plain_compile captured in one torch.cuda.CUDAGraph and replayed
  ours_eager_compiled         embedjob's adapter (`load_adapter`), blocks compiled as a job
                              compiles them (`pipeline.compile_if_asked`: dynamic=True), no graphs
  ours_graphs_compiled        the same through `GraphManager`: one graph for the batch, replayed
  ours_graphs_compiled_static the blocks compiled with dynamic=False instead
  ours_graphs_cd_tuned        dynamic=False, inductor's coordinate descent tuning of its kernels'
                              launch configurations (`encoder_only.TUNED`)
  ours_graphs_autotuned       dynamic=False, max_autotune as well: the compiler's own GEMM kernels
                              (their epilogues fused) where they time faster than cuBLAS's
  ours_graphs_whole_compiled  the whole tower compiled (`tower.compile()`) instead of its blocks
  <variant>[cudnn|flash|efficient]  plain_compile and ours_graphs_compiled with SDPA forced to
                              one backend while compiling, capturing and timing

The plain variants get float pixel values normalised beforehand (outside the timing); the
adapter's take uint8 and normalise inside its forward (inside the graph), as in a job. The
graph rows replay the graph alone: the batch is copied into its buffers once, so no row
pays a host-to-device copy. Times are CUDA-event medians after a warm-up; "setup s" is
load + compile + capture + the first run. MFU is the tower's FLOPs per image (below) over
the time, against a bf16 matmul timed in the same run. "vs plain_compile" is plain_compile's
time over the row's (above 1: faster; the issue's target is 1.1 for ours_graphs_compiled).
Rows are appended to --out as they finish, so a killed run leaves what it measured; the
table is printed at the end. `--variants` picks rows (plain_eager always runs), so a run
can be split across commands.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.metadata
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.encoder_only import TUNED, module_settings  # noqa: E402
from benchmarks.common import matmul_peak  # noqa: E402
from embedjob.bench import FIXED_TOWERS, device_time, fixed_flops, save_fixed_tower  # noqa: E402
from embedjob.config import job_from_dict  # noqa: E402
from embedjob.encoders import EncoderAdapter, EncoderInput, StaticInputs, base, load_adapter  # noqa: E402
from embedjob.encoders.fixed import FAMILIES, GLOBAL_KEY, load_processing  # noqa: E402
from embedjob.engine.graphs import GraphManager  # noqa: E402
from embedjob.engine.packer import BudgetPlan  # noqa: E402

NAMES = {"siglip": "SigLIP-so400m-384", "clip": "CLIP-L/14-336"}
# The towers this script's plain-transformers variants know (`plain_model`); `embedjob bench` times the others.
TOWERS = {family: values for family, (_, values) in FIXED_TOWERS.items() if family in NAMES}
SMOKE_TOWER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16)
SDPA_BACKENDS = {
    "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
    "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
    "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
}
CUDA_ONLY_BACKENDS = {"cudnn", "efficient"}  # the CPU has flash (and math) only

Run = Callable[[], torch.Tensor]


class Skipped(Exception):
    """A variant that cannot run here (not an error of the variant)."""


@dataclass
class Bench:
    """One model's checkpoint and the batch every variant of it runs on."""

    family: str
    directory: Path
    device: torch.device
    dtype: torch.dtype
    pixels: torch.Tensor  # (batch, 3, h, w) uint8 on the device
    float_pixels: torch.Tensor  # the same normalised, in `dtype`: the plain models' input
    flops_per_image: float
    repeats: int
    reference: torch.Tensor | None = None  # plain_eager's embeddings, float32
    attention: dict[str, str] = field(default_factory=dict)  # config._attn_implementation, plain and ours

    @property
    def batch(self) -> int:
        return self.pixels.shape[0]


@dataclass
class Row:
    model: str
    variant: str
    batch: int
    seconds: float | None = None
    setup: float | None = None
    mfu: float | None = None
    cosine: float | None = None
    note: str = ""


# --- the towers -----------------------------------------------------------------------


def save_tower(family: str, directory: Path, smoke: bool) -> Any:
    """The family's tower saved as `embedjob bench` saves it (`save_fixed_tower`); its vision config."""
    values = dict(SMOKE_TOWER, **({"projection_dim": 32} if family == "clip" else {})) if smoke else TOWERS[family]
    save_fixed_tower(family, values, directory)
    return transformers.AutoConfig.from_pretrained(directory)


def flops_per_image(family: str, config: Any) -> float:
    """`embedjob.bench.fixed_flops` of the tower (the SigLIP head and CLIP's projection included)."""
    return fixed_flops(family, config, getattr(config, "projection_dim", None) if family == "clip" else None)


def make_bench(family: str, workdir: Path, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> Bench:
    directory = workdir / family
    config = save_tower(family, directory, args.smoke)
    side = config.image_size
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (args.batch, 3, side, side), dtype=torch.uint8, generator=generator).to(device)
    processing = load_processing(FAMILIES[family], directory, config, 0)
    float_pixels = processing.normalize(pixels, processing.pixel_scale(device)).to(dtype)
    return Bench(family, directory, device, dtype, pixels, float_pixels, flops_per_image(family, config), args.repeats)


# --- variants: each builds what it runs and returns one call giving the batch's embeddings


def plain_model(b: Bench) -> torch.nn.Module:
    cls = transformers.CLIPVisionModelWithProjection if b.family == "clip" else transformers.SiglipVisionModel
    model = cls.from_pretrained(b.directory, dtype=b.dtype).to(b.device).eval().requires_grad_(False)
    b.attention["plain"] = model.config._attn_implementation
    return model


def plain_call(b: Bench, model: Callable[..., Any]) -> Run:
    """The family's image embedding, as `get_image_features` gives it."""
    if b.family == "clip":
        return lambda: model(pixel_values=b.float_pixels).image_embeds
    return lambda: model(pixel_values=b.float_pixels).pooler_output


def plain_eager(b: Bench) -> Run:
    return plain_call(b, plain_model(b))


def plain_compile(b: Bench) -> Run:
    return plain_call(b, torch.compile(plain_model(b)))


def plain_compile_graphs(b: Bench) -> Run:
    if b.device.type != "cuda":
        raise Skipped("needs CUDA")
    run = plain_compile(b)
    # Warm up (and compile) on a side stream before capturing, as GraphManager does.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


def ours_adapter(b: Bench, compile_: Callable[[EncoderAdapter], None]) -> EncoderAdapter:
    job = job_from_dict(
        {
            "input": {"path": "unused.parquet", "media_column": "image"},
            "model": {"family": b.family, "path": str(b.directory), "dtype": "bfloat16"},
            "output": {"path": "unused"},
            "batching": {"compile": True},
            "runtime": {"cache_dir": str(b.directory.parent / "cache")},
        }
    )
    adapter = load_adapter(job, b.device)
    b.attention["ours"] = adapter.tower.config._attn_implementation
    compile_(adapter)
    return adapter


def job_compile(adapter: EncoderAdapter) -> None:
    """What `pipeline.compile_if_asked` does for every job: each block, dynamic shapes."""
    adapter.compile(dynamic=True)


def static_compile(adapter: EncoderAdapter) -> None:
    adapter.compile(dynamic=False)


def tuned_compile(options: dict[str, Any]) -> Callable[[EncoderAdapter], None]:
    """The blocks compiled static with inductor's `options` (`encoder_only.TUNED`)."""

    def compile_(adapter: EncoderAdapter) -> None:
        with module_settings({(base, "COMPILE_OPTIONS"): options}):
            adapter.compile(dynamic=False)

    return compile_


def whole_compile(adapter: EncoderAdapter) -> None:
    adapter.tower.compile()


def ours_eager_compiled(b: Bench) -> Run:
    adapter = ours_adapter(b, job_compile)
    inputs = StaticInputs({GLOBAL_KEY: b.pixels})
    return lambda: adapter.forward(inputs)


def ours_graphs(b: Bench, compile_: Callable[[EncoderAdapter], None]) -> Run:
    """One graph for the whole batch (one budget of batch x tokens_per_image), captured
    by GraphManager ("replay" backend on the CPU, which re-runs the body)."""
    adapter = ours_adapter(b, compile_)
    per_image = adapter.tokens_per_image
    budget = b.batch * per_image
    manager = GraphManager(adapter, BudgetPlan((budget,), max_items=b.batch, max_frames=0), "cuda" if b.device.type == "cuda" else "replay")
    manager.capture()
    host = b.pixels.cpu()
    items = [EncoderInput({GLOBAL_KEY: host[k : k + 1]}, tokens=per_image, frames=0, size=per_image) for k in range(b.batch)]
    manager.padded_inputs(items, budget)
    # Replay the graph alone on the buffers just filled: the pixels stay on the device as in
    # the plain rows (`run_batch` would add assembling and copying the batch each time).
    graph = manager._graphs[budget].graph

    def replay() -> torch.Tensor:
        graph.replay()
        return graph.output

    return replay


VARIANTS: dict[str, Callable[[Bench], Run]] = {
    "plain_eager": plain_eager,
    "plain_compile": plain_compile,
    "plain_compile_graphs": plain_compile_graphs,
    "ours_eager_compiled": ours_eager_compiled,
    "ours_graphs_compiled": lambda b: ours_graphs(b, job_compile),
    "ours_graphs_compiled_static": lambda b: ours_graphs(b, static_compile),
    **{f"ours_graphs_{name.replace('-', '_')}": functools.partial(ours_graphs, compile_=tuned_compile(options)) for name, options in TUNED.items()},
    "ours_graphs_whole_compiled": lambda b: ours_graphs(b, whole_compile),
}
FORCED = ("plain_compile", "ours_graphs_compiled")  # run again under each SDPA backend


def variant_list(chosen: list[str] | None) -> list[tuple[str, str | None]]:
    """(variant, SDPA backend or None) in run order: plain_eager first and always (the
    cosines' reference), plain_compile second (the ratio's denominator)."""
    runs = [(v, None) for v in VARIANTS] + [(v, k) for k in SDPA_BACKENDS for v in FORCED]
    wanted = {"plain_eager", *chosen} if chosen is not None else None
    return [(v, k) for v, k in runs if wanted is None or (v if k is None else f"{v}[{k}]") in wanted]


# --- measuring ------------------------------------------------------------------------


def median_seconds(run: Run, repeats: int, device: torch.device) -> float:
    return device_time(run, repeats, device, warmup=3 if device.type == "cuda" else 1)


def measure(b: Bench, variant: str, backend: str | None, peak: float) -> Row:
    """One row; an exception makes a row with the error as its note, so the rest still run."""
    name = variant if backend is None else f"{variant}[{backend}]"
    row = Row(NAMES[b.family], name, b.batch)
    forced = torch.nn.attention.sdpa_kernel([SDPA_BACKENDS[backend]]) if backend else contextlib.nullcontext()
    run = output = None
    start = time.perf_counter()
    try:
        if backend in CUDA_ONLY_BACKENDS and b.device.type != "cuda":
            raise Skipped("needs CUDA")
        with forced, torch.inference_mode():
            run = VARIANTS[variant](b)
            output = run().float().clone()  # compiles (where nothing did yet)
            _sync(b.device)
            row.setup = time.perf_counter() - start
            row.seconds = median_seconds(run, b.repeats, b.device)
        row.mfu = b.flops_per_image * b.batch / row.seconds / peak
        if variant == "plain_eager" and backend is None:
            b.reference = output
        if b.reference is not None:
            row.cosine = float(torch.nn.functional.cosine_similarity(output, b.reference, dim=-1).min())
        if not torch.isfinite(output).all():
            row.note = "non-finite embeddings"
    except Skipped as exc:
        row.note = f"skipped: {exc}"
    except Exception as exc:
        row.note = f"error: {reason(exc)}"
    finally:
        # Free this variant's model, compiled code and graph before the next one builds its own.
        del run, output
        torch._dynamo.reset()
        gc.collect()
        if b.device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def reason(exc: Exception) -> str:
    """The error in one line. Dynamo wraps an operator's error (e.g. no SDPA kernel for a
    forced backend) in a generic first line and names the real one further down."""
    text = str(exc).strip()
    wrapped = re.search(r"got (\w+\(.*\))\s*$", text, re.MULTILINE)
    line = wrapped.group(1) if wrapped else (text.splitlines() or [""])[0]
    return f"{type(exc).__name__}: {line[:200]}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- output ---------------------------------------------------------------------------

COLUMNS = f"{'model':<18} {'variant':<34} {'images/s':>9} {'ms/batch':>9} {'MFU':>6} {'vs plain_compile':>16} {'min cos':>9} {'setup s':>8}  note"


def render_row(row: Row, base: float | None) -> str:
    if row.seconds is None:
        return f"{row.model:<18} {row.variant:<34} {'-':>9} {'-':>9} {'-':>6} {'-':>16} {'-':>9} {'-':>8}  {row.note}"
    ratio = f"{base / row.seconds:.3f}x" if base else "-"
    cosine = f"{row.cosine:.6f}" if row.cosine is not None else "-"
    return (
        f"{row.model:<18} {row.variant:<34} {row.batch / row.seconds:>9.1f} {row.seconds * 1e3:>9.2f} {row.mfu:>6.1%} "
        f"{ratio:>16} {cosine:>9} {row.setup:>8.1f}  {row.note}"
    )


def baseline(rows: list[Row], model: str) -> float | None:
    """plain_compile's seconds for `model`: the ratio's denominator (higher ratio = faster)."""
    return next((r.seconds for r in rows if r.model == model and r.variant == "plain_compile"), None)


def header(device: torch.device, dtype: torch.dtype, peak: float, batch: int) -> list[str]:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (--smoke: plumbing only)"
    versions = f"torch {torch.__version__}, transformers {importlib.metadata.version('transformers')}"
    unit = "bf16" if dtype == torch.bfloat16 else "fp32"
    return [
        f"fixed-resolution towers vs plain transformers + torch.compile, batch {batch}, {str(dtype).removeprefix('torch.')}",
        f"device {name}; {versions}; {unit} matmul {peak / 1e12:.1f} TFLOP/s",
    ]


def append(path: Path | None, lines: list[str]) -> None:
    if path is not None:
        with path.open("a") as out:
            out.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(TOWERS), default=list(TOWERS))
    parser.add_argument("--batch", type=int, default=None, help="images per batch (256; 4 with --smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant (20; 2 with --smoke)")
    parser.add_argument(
        "--variants", nargs="+", default=None,
        help="only these rows (plus plain_eager), e.g. plain_compile 'ours_graphs_compiled[flash]'; all by default",
    )
    parser.add_argument("--smoke", action="store_true",
                        help="tiny towers on the CPU, plain_compile and ours_graphs_compiled unless --variants: checks the script")
    parser.add_argument("--out", type=Path, default=None, help="append each finished row to this file")
    args = parser.parse_args()
    args.batch = args.batch or (4 if args.smoke else 256)
    if args.smoke and args.variants is None:  # compiling every variant on a CPU takes minutes
        args.variants = ["plain_compile", "ours_graphs_compiled"]
    args.repeats = args.repeats or (2 if args.smoke else 20)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/fixed_compile.py needs a CUDA device (or --smoke)")
    unknown = set(args.variants or ()) - {f"{v}[{k}]" if k else v for v, k in variant_list(None)}
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    device = torch.device("cpu" if args.smoke else "cuda")
    # bf16 on the GPU; float32 on the CPU, where load_adapter computes in float32 whatever the job says.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per variant buries the rows
    peak = matmul_peak(device, "fixed_compile")
    lines = header(device, dtype, peak, args.batch)
    append(args.out, [*lines, COLUMNS])
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as workdir:
        # One cold inductor cache for every variant (adapter.compile would point its own at
        # the job's cache dir), so setup times compare within the run.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(workdir) / "cache" / "inductor")
        for family in args.models:
            bench = make_bench(family, Path(workdir), device, dtype, args)
            for variant, backend in variant_list(args.variants):
                row = measure(bench, variant, backend, peak)
                rows.append(row)
                append(args.out, [render_row(row, baseline(rows, row.model))])
            attention = ", ".join(f"{k} {v}" for k, v in bench.attention.items())
            lines.append(f"{NAMES[family]}: {bench.flops_per_image / 1e9:.1f} GFLOP/image; attention: {attention}")
            append(args.out, [lines[-1]])
            del bench  # frees this model's batch before the next model's is made
    print("\n".join([*lines, COLUMNS, *(render_row(r, baseline(rows, r.model)) for r in rows)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
