"""FP8 per layer: each linear layer's error in row-wise FP8 on real photos, and the cosine to bf16 that keeping the worst layers in bf16 buys (RESULTS.md section 6).

On the GPU machine, from the repository root (`bench-data`: photos, as in scaling.py):

    PYTHONPATH=. python3 benchmarks/fp8_layers.py --photos bench-data --mixes siglip qwen-mixed [--images 64] [--keep 0 2 4 8]

For each mix (`benchmarks/mixes.py`: its tower at the published size, random bf16 weights,
seed 0, and its distinct JPEGs cut from the photos), the items run eagerly through the
tower twice. First in bf16, with a hook on every linear layer of the blocks (what
`model.precision: fp8` converts, `compile_units`): each layer's product on (at most
`--rows` of) the rows it reads is done again in FP8 as `encoders.fp8` does it (the rows
quantised to e4m3 with one scale each, the weight with one scale per output channel,
`fp8.quantize_rows`; the products and the bias in float32) and its relative error
||fp8 - exact|| / ||exact|| summed over the batches. Then, for each `--keep` k, every
such layer but the k with the largest error runs in that FP8 (simulated: the same
quantisation, the product in float32, so any device runs it) and the table gives each
item's cosine to its vector without FP8 (the reference: bf16 on a GPU, float32 on a
CPU), min and median: how many layers kept in bf16 the 0.995
target of issue #57 takes, and which ones (block index and name, worst first). With
`--kinds`, one more pass per kind of layer (its path in a block, such as `mlp.fc2`)
keeps that kind in bf16 in every block, the rest in FP8: the cosine keeping it buys,
beside its share of the blocks' products (multiply-adds per token), which is about the
share of FP8's speed-up it gives back. `--kept PATH...` keeps those kinds in bf16 in
every FP8 pass, as `model.fp8_keep` does (so `--kinds` then gives the pairs).
`--calibrate K` runs each `--keep` pass a second time with calibrated FP8 weights: each
layer's weight rounded to e4m3 column by column, the rounding error of each column
pushed onto the columns not yet rounded as the Hessian of the layer's inputs on the
first K items says (error-compensated rounding, as GPTQ does), at no cost to the
product; every cosine is then over the other items only, so none was calibrated on.
`--smoke` runs tiny towers of the same architectures on 8 images on the CPU. The table is
written to `<workdir>/fp8_layers.md` and printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import builtin_sources, collect_photos, cosine  # noqa: E402
from benchmarks.common import log as _log  # noqa: E402
from benchmarks.encoder_only import module_settings, preprocess_rows  # noqa: E402
from benchmarks.mixes import MIXES, jpeg_dataset, save_tower, write_job  # noqa: E402
from embedjob.config import load_job  # noqa: E402
from embedjob.encoders import epilogues, load_adapter  # noqa: E402
from embedjob.encoders.fp8 import calibrated_rows, input_products, quantize_rows  # noqa: E402
from embedjob.engine import packer  # noqa: E402
from embedjob.engine.encode import budget_plan  # noqa: E402
from embedjob.engine.graphs import GraphManager, pool_rows  # noqa: E402

SMOKE_IMAGES = 8
WORST_SHOWN = 12


def log(message: str) -> None:
    """Progress on stderr."""
    _log("fp8_layers", message)


def fp8_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` quantised to e4m3 with one scale per output channel, as `encoders.fp8`
    quantises it once at load, dequantised to float32."""
    wq, wscale = quantize_rows(weight)
    return wq.float() * wscale


def fp8_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) with x quantised per row to e4m3, as `encoders.fp8` quantises
    it, and `weight` already quantised (`fp8_weight`); multiplied in float32."""
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = (q.float() * scale) @ weight.T
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], weight.shape[0])


@dataclass
class LayerError:
    """One linear layer's squared error and squared norm of its exact output, summed."""

    name: str
    error: float = 0.0
    norm: float = 0.0

    @property
    def relative(self) -> float:
        return (self.error / self.norm) ** 0.5 if self.norm > 0 else 0.0


@dataclass
class Layers:
    """The linear layers of the tower's blocks, by name ("block 3: mlp.fc1"), and their
    FP8 weights (`fp8_weight`, made once per layer at its first use)."""

    modules: dict[str, torch.nn.Linear]
    errors: dict[str, LayerError] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    calibrated: dict[str, torch.Tensor] = field(default_factory=dict)

    def fp8(self, name: str, calibrated: bool = False) -> torch.Tensor:
        if calibrated:
            if name not in self.calibrated:
                self.calibrated[name] = calibrated_weight(self.modules[name].weight, self.hessians[name])
            return self.calibrated[name]
        if name not in self.weights:
            self.weights[name] = fp8_weight(self.modules[name].weight)
        return self.weights[name]


def calibrated_weight(weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """`weight` rounded to e4m3 as a job with `model.fp8_calibrate` rounds it
    (`fp8.calibrated_rows`, `hessian` the sum of x^T x over the inputs seen), dequantised to float32."""
    quantized, scale = calibrated_rows(weight, hessian)
    return quantized.float() * scale


def kind(name: str) -> str:
    """A layer's path within its block: "block 3: mlp.fc1" -> "mlp.fc1"."""
    return name.split(": ", 1)[1]


def kind_shares(layers: Layers) -> dict[str, float]:
    """Each kind's share of the blocks' multiply-adds per token (in x out summed over the
    blocks); every layer of a block reads the same tokens, so this is its share of the products."""
    sizes: dict[str, int] = {}
    for name, module in layers.modules.items():
        sizes[kind(name)] = sizes.get(kind(name), 0) + module.in_features * module.out_features
    total = sum(sizes.values())
    return {k: size / total for k, size in sizes.items()}


def linear_layers(adapter: Any) -> Layers:
    """Every `torch.nn.Linear` of the adapter's blocks (`compile_units`), named by block and path."""
    modules = {}
    for k, block in enumerate(adapter.compile_units()):
        for path, module in block.named_modules():
            if isinstance(module, torch.nn.Linear):
                modules[f"block {k}: {path}"] = module
    return Layers(modules)


@contextmanager
def reading_inputs(layers: Layers, seen: Callable[[str, torch.nn.Linear, torch.Tensor], None]) -> Iterator[None]:
    """While inside, every layer's forward first hands `seen` its name, itself and its input as rows."""

    def hook(name: str, module: torch.nn.Linear):
        def read(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen(name, module, args[0].reshape(-1, args[0].shape[-1]))
        return read

    handles = [module.register_forward_pre_hook(hook(name, module)) for name, module in layers.modules.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def measuring(layers: Layers, rows: int) -> AbstractContextManager[None]:
    """While inside, every layer's forward also adds its FP8 product's error on (a spread
    of at most `rows` of) its input rows to `layers.errors`."""

    def measure(name: str, module: torch.nn.Linear, x: torch.Tensor) -> None:
        if x.shape[0] > rows:
            x = x[torch.linspace(0, x.shape[0] - 1, rows, device=x.device).long()]
        exact = torch.nn.functional.linear(x.float(), module.weight.float(), None if module.bias is None else module.bias.float())
        seen = layers.errors.setdefault(name, LayerError(name))
        seen.error += float((fp8_product(x, layers.fp8(name), module.bias) - exact).pow(2).sum())
        seen.norm += float(exact.pow(2).sum())

    return reading_inputs(layers, measure)


@contextmanager
def collecting(layers: Layers) -> Iterator[None]:
    """While inside, every layer's x^T x of its input rows is summed (`fp8.input_products`,
    as a calibrating job sums them), and on leaving put in `layers.hessians`."""
    with input_products(layers.modules.values()) as products:
        yield
    layers.hessians.update({name: products[module] for name, module in layers.modules.items() if module in products})


@contextmanager
def simulated_fp8(layers: Layers, names: list[str], calibrated: bool = False) -> Iterator[None]:
    """While inside, the layers `names` compute their products in FP8 (`fp8_product`; the
    weights `calibrated_weight`'s where `calibrated`), the result cast to the layer's dtype
    as the FP8 kernels return it."""
    originals = {name: layers.modules[name].forward for name in names}
    for name in names:
        module = layers.modules[name]
        weight = layers.fp8(name, calibrated)
        module.forward = lambda x, m=module, w=weight: fp8_product(x, w, m.bias).to(x.dtype)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, forward in originals.items():
            layers.modules[name].forward = forward  # type: ignore[method-assign]


def pooled(job: Any, adapter: Any, items: list[Any]) -> np.ndarray:
    """Each item's pooled vector (float32), the items packed as a job packs them and run eagerly."""
    plan = budget_plan(job, adapter)
    manager = GraphManager(adapter, plan, None)
    out: list[np.ndarray | None] = [None] * len(items)
    for batch in packer.pack([i.tokens for i in items], [i.frames for i in items], plan, job.batching.policy):
        chosen = [items[i] for i in batch.indices]
        with torch.inference_mode():
            vectors, _ = pool_rows(manager.run_batch(chosen, None), adapter.row_counts(chosen), "mean")
        for index, vector in zip(batch.indices, vectors.float().cpu().numpy()):
            out[index] = vector
    return np.stack(out)


def bench_mix(name: str, args: argparse.Namespace, photos: list[Any], device: torch.device) -> dict[str, Any]:
    mix = MIXES[name]
    workdir = Path(args.workdir).resolve()
    count = SMOKE_IMAGES if args.smoke else args.images
    dataset = jpeg_dataset(mix, count, args.seed, photos, workdir / "data", len(os.sched_getaffinity(0)))
    tower = save_tower(mix.tower, workdir / "towers", args.smoke)
    job = load_job(write_job(workdir / name, mix, tower, dataset.path, workdir / "cache", args.smoke), ["batching.compile=false"])
    # An fp8 job's blocks have no bf16 epilogues (SigLIP's fc1 with its GELU stays a linear layer), so neither do these.
    with module_settings({(epilogues, "EPILOGUES"): False}):
        adapter = load_adapter(job, device)
    items, failed = preprocess_rows(job, adapter, len(os.sched_getaffinity(0)))
    log(f"[{name}] {len(items)} items ({failed} did not decode); bf16 with the layers' FP8 errors measured")
    layers = linear_layers(adapter)
    with measuring(layers, args.rows):
        reference = pooled(job, adapter, items)
    if args.calibrate:
        with collecting(layers):
            pooled(job, adapter, items[: args.calibrate])
        items, reference = items[args.calibrate :], reference[args.calibrate :]
        log(f"[{name}] inputs of the first {args.calibrate} items collected; cosines over the other {len(items)}")
    worst = sorted(layers.errors.values(), key=lambda e: e.relative, reverse=True)
    sweeps = []
    always = {n for n in layers.modules if kind(n) in args.kept}
    for calibrated in (False, True) if args.calibrate else (False,):
        for keep in args.keep:
            kept = {e.name for e in worst[:keep]} | always
            log(f"[{name}] every linear layer in FP8 but the {keep} worst{', calibrated weights' if calibrated else ''}")
            with simulated_fp8(layers, [n for n in layers.modules if n not in kept], calibrated):
                cos = cosine(pooled(job, adapter, items), reference)
            weights = f"calibrated on {args.calibrate} items" if calibrated else "rounded"
            sweeps.append((weights, keep, len(layers.modules) - len(kept), float(cos.min()), float(np.median(cos))))
    kinds = []
    if args.kinds:
        for each, share in sorted(kind_shares(layers).items(), key=lambda pair: -pair[1]):
            if each in args.kept:
                continue
            log(f"[{name}] every linear layer in FP8 but {each}")
            with simulated_fp8(layers, [n for n in layers.modules if kind(n) != each and n not in always]):
                cos = cosine(pooled(job, adapter, items), reference)
            kinds.append((each, share, float(cos.min()), float(np.median(cos))))
    return {"mix": name, "tower": mix.tower.describe(args.smoke), "items": len(items), "worst": worst, "sweeps": sweeps,
            "kinds": kinds, "layers": len(layers.modules), "dtype": str(adapter.dtype).removeprefix("torch.")}


def render(results: list[dict[str, Any]], args: argparse.Namespace, device: torch.device, wall: float) -> str:
    lines = [
        f"# FP8 per layer, simulated e4m3 (rows, and weights per output channel) ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"device: {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
        f"command: {' '.join(sys.argv)}; wall {wall:.0f} s",
    ]
    for result in results:
        lines += [
            "",
            f"## {result['mix']}: {result['tower']}, {result['items']} items, {result['layers']} linear layers in the blocks, "
            f"reference in {result['dtype']}",
            "",
            f"Relative errors of the {result['layers']} FP8 products: {result['worst'][-1].relative:.2e} to {result['worst'][0].relative:.2e}, "
            f"median {float(np.median([e.relative for e in result['worst']])):.2e}.",
            "",
            "| layer (worst first) | relative error of its FP8 product |",
            "| --- | ---: |",
            *(f"| {e.name} | {e.relative:.2e} |" for e in result["worst"][:WORST_SHOWN]),
            "",
            *([f"Kept in bf16 in every pass (--kept): {', '.join(args.kept)}.", ""] if args.kept else []),
            *([f"Cosines over the {result['items']} items after the {args.calibrate} the calibrated weights were calibrated on.", ""]
              if args.calibrate else []),
            "| FP8 weights | kept in bf16 (the worst) | layers in FP8 | cos to the reference min | median |",
            "| --- | ---: | ---: | ---: | ---: |",
            *(f"| {weights} | {keep} | {fp8} | {low:.5f} | {median:.5f} |" for weights, keep, fp8, low, median in result["sweeps"]),
        ]
        if result["kinds"]:
            lines += [
                "",
                "| kept in bf16 in every block | its share of the products | cos to the reference min | median |",
                "| --- | ---: | ---: | ---: |",
                *(f"| {each} | {share:.1%} | {low:.5f} | {median:.5f} |" for each, share, low, median in result["kinds"]),
            ]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    start = time.perf_counter()
    photos = collect_photos([*builtin_sources(), *args.photos])
    results = [bench_mix(name, args, photos, device) for name in args.mixes]
    text = render(results, args, device, time.perf_counter() - start)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "fp8_layers.md").write_text(text + "\n")
    print(text, flush=True)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", nargs="+", type=Path, default=[], help="photos the mixes' JPEGs are cut from")
    parser.add_argument("--mixes", nargs="+", choices=sorted(MIXES), default=["siglip", "qwen-mixed"])
    parser.add_argument("--images", type=int, default=64, help="items per mix")
    parser.add_argument("--keep", nargs="+", type=int, default=[0, 2, 4, 8], help="how many of the worst layers stay in bf16, one pass each")
    parser.add_argument("--kept", nargs="+", default=[], help="kinds of layer (mlp.fc2) kept in bf16 in every block in every pass")
    parser.add_argument("--calibrate", type=int, default=0, help="items whose layer inputs calibrate the FP8 weights (0: none)")
    parser.add_argument("--kinds", action="store_true", help="one more pass per kind of layer, that kind kept in bf16 in every block")
    parser.add_argument("--rows", type=int, default=1024, help="the most input rows of one batch each layer's error is measured on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/fp8_layers")
    parser.add_argument("--smoke", action="store_true", help=f"CPU only: tiny towers, {SMOKE_IMAGES} images")
    return parser.parse_args()


if __name__ == "__main__":
    raise SystemExit(main())
