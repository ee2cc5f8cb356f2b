"""The model side of the graph protocol, shared by every encoder family.

An adapter turns decoded media into `EncoderInput`s (on the CPU, in decode workers),
and runs batches of them on the device, either eagerly at their exact size or through
static, budget-sized buffers that a captured graph reads. Everything that differs
between families lives in the subclasses; the graph manager and the pipeline only use
the methods declared here.

Invariants every adapter keeps:
- `EncoderInput.tokens` is what the item costs in a token budget (the encoder tokens it
  occupies), and `row_counts` gives each item's number of output rows, which `split`
  cuts in batch order: one per output token for native-resolution towers (Qwen-VL), and
  for fixed-resolution ones (CLIP, SigLIP, DINOv2) one per view (image or video frame),
  or one per patch token of each view when the job asks for per-token output.
- Batch assembly (`batch_values`, `eager_inputs`) runs on the pipeline's main thread:
  it makes a constant number of torch calls per batch, not per item (each call costs
  microseconds and releases and re-takes the GIL, which the process's other threads
  compete for), and assembles in page-locked memory when the device is CUDA, so the
  copies to the device are asynchronous.
- `forward(static_inputs(budget))` writes real rows first and never lets pad rows
  influence real rows, so a batch's graph output equals its eager output on the same
  padded buffers.
"""

from __future__ import annotations

import abc
import logging
import os
import pickle
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from embedjob.encoders.attention import HALF

logger = logging.getLogger(__name__)

Calibration = Callable[["EncoderAdapter"], Mapping[torch.nn.Module, torch.Tensor]]
"""What `EncoderAdapter.use_fp8` calls to calibrate the FP8 weights: the adapter, its
blocks as loaded, in; each linear layer's input product out (`fp8.input_products`)."""

WIDE_ROWS = 4096
"""The widest row that compiled blocks reduce in one pass (a persistent reduction, the row
held whole) rather than in a loop over parts of it; 0 leaves torch's own rule (rows of up
to 1,024). The towers' norms reduce rows of 1,152 (SigLIP-so400m) and 1,280 (Qwen2.5-VL)
elements: looped, each norm reads its row twice. Read when an adapter compiles."""

COMPILE_OPTIONS: dict[str, Any] | None = None
"""Inductor's options for compiling the blocks (torch.compile's `options`; None: its
defaults). {"coordinate_descent_tuning": True} has the compiler time its elementwise and
reduction kernels' launch configurations; with "max_autotune" it also times its own GEMM
kernels, with the elementwise work around them fused in, against cuBLAS's (minutes of
compiling). Neither beat the defaults on CLIP-L or the Qwen2.5-VL tower on an H200
(benchmarks/RESULTS.md's git history), so jobs keep None; the benchmarks set it
(`benchmarks/encoder_only.py`, `TUNED`). Read when an adapter compiles."""

PAD_ZERO = "zero"
PAD_REPEAT_LAST = "repeat_last"
JPEG_KEY = "jpeg"
"""An item tensor of a JPEG's bytes (1-d uint8) that the rank decodes on its GPU
(`preprocess.decoder: gpu`); `Preprocessor.on_device` replaces it by the item's pixels."""
JPEG_SIZE_KEY = "jpeg_size"
"""The (height, width) of that JPEG, from its frame header."""
VIDEO_KEY = "video"
"""An item tensor of a video's bytes whose sampled frames the rank's GPU decodes
(`video.decoder: nvdec`); `Preprocessor.on_device_video` makes the item's pixels."""


@dataclass
class EncoderInput:
    """One preprocessed item, ready to be packed.

    `tensors` are CPU tensors whose layout only the adapter understands; `tokens` is what
    the item costs in a token budget, `frames` the number of video frames (0 for an
    image) and `size` the input cost used for load balancing (e.g. patches). `grid`
    holds the few integers batch assembly needs about the item's layout (Qwen-VL: the
    patch grid (t, h, w)) as plain Python ints, so a batch of items is assembled with
    a constant number of torch calls instead of one `.tolist()` per item; empty where
    an adapter needs none. `token_grid` is the (t, h, w) grid of the item's output
    tokens, in the order a per-token forward outputs them (t * h * w rows): what the
    output's `grid` column carries, so a user can put the rows back into a map.
    """

    tensors: dict[str, torch.Tensor]
    tokens: int
    frames: int
    size: int
    modality: str = "image"
    grid: tuple[int, ...] = ()
    token_grid: tuple[int, ...] = ()

    def __reduce_ex__(self, protocol: int) -> tuple[Any, tuple[Any, ...]]:
        """Pickle each tensor as its raw bytes: a `pickle.PickleBuffer` over the tensor's
        memory from protocol 5 on (sent out of band by a `buffer_callback`, or copied
        in band without one), a plain `bytes` copy below it (torch.distributed's object
        collectives pickle with the default protocol 4).

        Decode workers send items to the parent as protocol-5 pickles whose buffers go
        over the socket without a copy on either side; torch's own tensor pickling moves
        each tensor through a shared-memory segment and a file-descriptor handshake, a
        round trip per tensor that costs more than the copy for items of these sizes.
        """
        packed = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape), _raw(v, protocol)) for k, v in self.tensors.items()}
        return (_rebuild_input, (packed, self.tokens, self.frames, self.size, self.modality, self.grid, self.token_grid))


def _raw(tensor: torch.Tensor, protocol: int) -> bytes | pickle.PickleBuffer:
    """The tensor's bytes in row-major order; for protocol >= 5 a view that keeps the
    tensor alive instead of a copy (unless the tensor is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return pickle.PickleBuffer(flat) if protocol >= 5 else flat.tobytes()


def _from_raw(dtype: str, shape: tuple[int, ...], raw: Any) -> torch.Tensor:
    """A tensor over the received buffer without copying it.

    Out-of-band buffers arrive writable (whatever the receiver allocated); `bytes`
    (protocol < 5) are immutable, which torch warns about. Either way item tensors are
    only ever read, so sharing the received memory is safe.
    """
    with memoryview(raw) as view:
        empty, readonly = view.nbytes == 0, view.readonly
    if empty:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    if readonly:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _rebuild_input(
    packed: dict[str, Any],
    tokens: int,
    frames: int,
    size: int,
    modality: str,
    grid: tuple[int, ...],
    token_grid: tuple[int, ...],
) -> EncoderInput:
    tensors = {k: _from_raw(*v) for k, v in packed.items()}
    return EncoderInput(tensors, tokens, frames, size, modality, grid, token_grid)


class Preprocessor(Protocol):
    """Picklable callable run in decode workers: decoded media -> EncoderInput.

    With `preprocess.decoder: gpu` the workers leave plain JPEGs undecoded: `deferred`
    makes the item of one from its header alone (everything but its pixels, under
    `JPEG_KEY`), and the rank's `on_device` fills in the pixels from the pictures its
    GPU decoded (those of one size in one call) by the same steps as `__call__`, so the
    item differs from the CPU path's only by the two decoders' rounding. With
    `video.decoder: nvdec` a video's item is made the same way (`deferred_video`,
    `on_device_video`) from its planned frame count and shown frame size."""

    frame_multiple: int

    def __call__(self, media: Any) -> EncoderInput: ...

    def deferred(self, data: torch.Tensor, height: int, width: int) -> EncoderInput: ...

    def on_device(self, items: list[EncoderInput], images: torch.Tensor) -> list[EncoderInput]: ...

    def deferred_video(self, frames: int, height: int, width: int) -> EncoderInput: ...

    def on_device_video(self, item: EncoderInput, frames: torch.Tensor) -> EncoderInput: ...


@dataclass(frozen=True)
class PathSpec:
    """One graph set an adapter's items run through, declared by the adapter.

    `key` None means the whole item (an adapter with one path); otherwise it names the
    item tensor this path encodes, which the adapter's `path_input` makes an ordinary
    item of. The first path is the one every item has; a further path may have no
    input from an item (an image without tiles). See ARCHITECTURE.md, row "graphs".
    """

    name: str
    key: str | None = None


@dataclass
class StaticInputs:
    """The buffers a captured graph reads, plus the pad rule of each buffer.

    `tensors` hold device tensors whose shapes depend only on the budget; `pad` maps a
    key to PAD_ZERO (zero the tail) or PAD_REPEAT_LAST (repeat the last written value,
    e.g. cumulative offsets); `constants` are Python values baked into the graph (such as
    attention length bounds) that every replay of this budget shares.
    """

    tensors: dict[str, torch.Tensor]
    pad: dict[str, str] = field(default_factory=dict)
    constants: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where and how an adapter runs: its device and compute dtype, where its weights
    came from (`model.path`), the most frames one video gives (the unit of the frame
    budgets; 0 without video), and where compiled artefacts are cached."""

    device: torch.device
    dtype: torch.dtype
    source: str
    max_frames_per_video: int
    cache_dir: Path


@dataclass(frozen=True)
class NamedSpec:
    """The spec of a family whose adapter reads nothing of it but its name (`family`)."""

    name: str


class EncoderAdapter(abc.ABC):
    """Base class of encoder families. Subclasses set the attributes below that `__init__`
    does not (the embedding width, the budget range, ...)."""

    family: str
    device: torch.device
    dtype: torch.dtype
    embed_dim: int
    min_budget: int
    max_budget: int
    max_frames_per_video: int
    cache_dir: Path
    # Budgets are rounded down to multiples of this: the tokens of one item where every
    # item costs the same (a fixed-resolution view), so no budget holds an unusable rest.
    budget_unit: int = 1
    # The graph sets an item runs through; several paths need `path_input` and `combine`.
    paths: tuple[PathSpec, ...] = (PathSpec("global"),)
    # The linear layers `use_fp8` converted, by name within a block: how many of each.
    fp8_layers: dict[str, int] = {}
    # The attention `forward` runs (stats `attention`): transformers' scaled-dot-product
    # attention unless a family runs its own ("varlen" or "fa4", `encoders.attention`).
    attention: str = "sdpa"
    # The text tower loaded beside this image tower from the same full checkpoint
    # (`encoders.text.TextAdapter`), where the job asks for captions or labels.
    text: EncoderAdapter | None = None

    def __init__(self, spec: Any, processing: Any, placement: Placement) -> None:
        """What every family has: its spec (`spec.name` is the family), the preprocessing
        its decode workers run, and where and how it runs (`Placement`)."""
        self.family = spec.name
        self.spec = spec
        self.processing = processing
        self.device = placement.device
        self.dtype = placement.dtype
        self.source = placement.source
        self.max_frames_per_video = placement.max_frames_per_video
        self.cache_dir = placement.cache_dir
        # Batches bound for a GPU are assembled in page-locked memory, so their copies
        # to the device are asynchronous.
        self.pin_memory = self.device.type == "cuda"

    @abc.abstractmethod
    def preprocessor(self) -> Preprocessor:
        """The CPU-side preprocessing, picklable so decode workers can run it."""

    @abc.abstractmethod
    def static_inputs(self, budget: int, max_items: int, max_frames: int) -> StaticInputs:
        """Device buffers for one budget, filled with a valid dummy batch (for warm-up and capture)."""

    def fits(self, items: list[EncoderInput], static: StaticInputs) -> bool:
        """Whether this batch fits the budget's buffers beyond its token count (e.g.
        attention segment slots); a batch that does not runs eagerly."""
        return True

    @abc.abstractmethod
    def batch_values(self, items: list[EncoderInput], static: StaticInputs) -> dict[str, torch.Tensor]:
        """CPU tensors of one batch, each no longer than its static buffer; the manager pads the tail."""

    @abc.abstractmethod
    def eager_inputs(self, items: list[EncoderInput]) -> StaticInputs:
        """Exact-size device inputs of one batch for eager execution (no padding)."""

    @abc.abstractmethod
    def forward(self, inputs: StaticInputs) -> torch.Tensor:
        """The encoder body: inputs -> output rows (real rows first, in item order)."""

    def compile_units(self) -> list[torch.nn.Module]:
        """The repeated modules worth compiling (e.g. transformer blocks); none by default."""
        return []

    @property
    def capturable(self) -> bool:
        """Whether `forward` can be captured in a CUDA graph on this adapter's device."""
        return True

    def use_fp8(self, keep: Sequence[str] = (), calibration: Calibration | None = None) -> None:
        """Run the linear layers of `compile_units` (the transformer blocks) in row-wise
        FP8 (`encoders.fp8`), but those at the paths `keep` (`model.fp8_keep`); a
        JobError, before any change, where the device cannot or `keep` names no block's
        linear layer. With `calibration`, called on this adapter while its blocks are
        as loaded, the weights are rounded by the input products it returns
        (`fp8.calibrated_rows`). Before `compile`, so the compiled blocks are those with
        the FP8 layers."""
        from embedjob.encoders.fp8 import check_fp8, check_kept, convert_blocks

        check_fp8(self.device, self.dtype)
        blocks = self.compile_units()
        check_kept(blocks, keep)
        inputs = None if calibration is None else calibration(self)
        since = time.perf_counter()
        self.fp8_layers = dict(convert_blocks(blocks, keep, inputs))
        logger.info(
            "model.precision fp8: %d linear layers of %d blocks in row-wise FP8 (%s%s); the patch embedding, "
            "attention, the norms that no FP8 layer applies and the layers outside the blocks in %s",
            sum(self.fp8_layers.values()), len(blocks), ", ".join(sorted(self.fp8_layers)),
            "" if inputs is None else f"; weights rounded to suit the calibration rows' inputs in {time.perf_counter() - since:.1f} s",
            str(self.dtype).removeprefix("torch."),
        )

    def use_epilogues(self) -> None:
        """Apply the blocks' MLP activations in the products' epilogues where cuBLASLt
        can (`encoders.epilogues`: SigLIP's tanh GELU), and the quick GELU through our Triton
        GEMM on the GPUs where it pays (`epilogues.triton_gemm_pays`); on CUDA in half
        precision, where those products run. Before `compile`, like `use_fp8`."""
        from embedjob.encoders.epilogues import fuse_gelu_epilogues, triton_gemm_pays

        fuse_gelu_epilogues(self.compile_units(), triton=triton_gemm_pays(self.device))

    def compile(self, dynamic: bool) -> None:
        """Compile `compile_units` in place with torch.compile (with `COMPILE_OPTIONS`).

        Graphs captured afterwards replay the compiled (fused) kernels. `dynamic` marks
        the sequence length symbolic, so one compilation serves every budget instead of
        one per budget; compiled artefacts are cached on disk under the cache root.
        """
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.cache_dir / "inductor"))
        reduce_rows_in_one_pass(WIDE_ROWS)
        if not dynamic:
            import torch._dynamo

            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for module in self.compile_units():
            module.compile(dynamic=dynamic, options=COMPILE_OPTIONS)

    def row_counts(self, items: list[EncoderInput]) -> list[int]:
        """How many rows each item has in `forward`'s output, in batch order (real rows
        come first, so item k's rows follow items 0..k-1's). Default: one row per
        output token (native-resolution towers)."""
        return [item.tokens for item in items]

    def split(self, output: torch.Tensor, items: list[EncoderInput]) -> list[torch.Tensor]:
        """Views of each item's rows in `output`, in batch order.

        One `split` call cuts every item's view; the last section takes a padded
        output's pad rows and is dropped.
        """
        counts = self.row_counts(items)
        return list(output.split([*counts, output.shape[0] - sum(counts)])[: len(counts)])

    def path_input(self, item: EncoderInput, key: str) -> EncoderInput | None:
        """With several `paths`: the part of `item` the path of `key` encodes, as an
        ordinary item, or None when the item has no input there."""
        raise NotImplementedError(f"{type(self).__name__} declares one path; path_input serves several")

    def combine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """With several `paths`: one item's rows from each path (by key) -> its output rows."""
        raise NotImplementedError(f"{type(self).__name__} declares one path; combine serves several")

    def describe(self) -> dict[str, Any]:
        """What identifies this encoder's outputs (for manifests and resume checks)."""
        info = {"family": self.family, "dtype": str(self.dtype).removeprefix("torch."), "embed_dim": self.embed_dim}
        if self.fp8_layers:
            info["precision"] = "fp8"
        return info


class PackedAdapter(EncoderAdapter):
    """A native-resolution tower run on packed batches, items of many sizes in one batch
    as attention segments (Qwen-VL, SigLIP 2 NaFlex): `blocks` are its transformer
    blocks (what `compile` compiles and FP8 converts), and `attention` runs the segments."""

    def __init__(self, spec: Any, processing: Any, placement: Placement, blocks: Any, attention: str) -> None:
        super().__init__(spec, processing, placement)
        self.blocks = list(blocks)
        self.attention = attention

    def compile_units(self) -> list[torch.nn.Module]:
        return self.blocks

    @property
    def capturable(self) -> bool:
        """Not in float32 on CUDA: its attention then runs per segment (`encoders.attention`)."""
        return self.device.type != "cuda" or self.dtype in HALF

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "source": self.source, **self.limits()}

    @abc.abstractmethod
    def limits(self) -> dict[str, Any]:
        """The preprocessing limits that decide each item's tokens (part of `describe`)."""

    @staticmethod
    def _grids(items: list[EncoderInput]) -> np.ndarray:
        """The items' (t, h, w) patch grids as an (items, 3) array, read without a torch call."""
        return np.array([item.grid for item in items], dtype=np.int64).reshape(-1, 3)

    @staticmethod
    def _view_patches(grids: np.ndarray) -> np.ndarray:
        """The patches of each view (an image, or a temporal group of a video: h * w
        each), every item's in batch order: the full-attention segments' lengths."""
        return np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])

    def _host(self, values: np.ndarray) -> torch.Tensor:
        """A host tensor over `values`, page-locked when it feeds a GPU."""
        tensor = torch.from_numpy(values)
        return tensor.pin_memory() if self.pin_memory else tensor


def reduce_rows_in_one_pass(width: int) -> None:
    """From now on, on this thread (where the blocks compile: their first call), the
    compiler reduces rows of up to `width` elements along the inner dimension in one pass
    (0: torch's own rule).

    torch's heuristic holds a row whole only up to 1,024 elements and otherwise loops over
    it, reading it once for the statistics and again to normalise. The handler is
    inductor's documented hook for its heuristics (`V.set_choices_handler`); every other
    choice stays torch's own."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class WideRows(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features: Any, cooperative_reduction: bool) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            return (
                config.triton.persistent_reductions
                and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER
                and V.graph.sizevars.statically_known_leq(features.reduction_numel, width)
            )

    V.set_choices_handler(WideRows() if width else InductorChoices())


MLP_LAYOUTS = ((("gate_proj", "up_proj"), "down_proj"), (("linear_fc1",), "linear_fc2"), (("fc1",), "fc2"))


def pad_mlp(mlp: torch.nn.Module, multiple: int) -> None:
    """Pad the MLP's hidden width to a multiple of `multiple` with zero channels.

    Qwen2.5-VL's 3420 is not a multiple of 8, so its rows are not 16-byte aligned and
    cuBLAS falls back to its slower pre-Hopper kernels (the kernel table in
    benchmarks/RESULTS.md's git history); SigLIP-so400m's 4304 is, but not of the
    products' 128-wide tiles (`fixed.MLP_MULTIPLE`). A zero channel has zero input weights
    and bias, every activation here maps 0 to 0, and its output weights are zero, so the
    padded MLP computes the same function.
    """
    for inputs, output in MLP_LAYOUTS:
        if all(hasattr(mlp, name) for name in (*inputs, output)):
            break
    else:
        return
    width = getattr(mlp, output).in_features
    extra = -width % multiple
    if not extra:
        return
    for name in inputs:
        layer = getattr(mlp, name)
        setattr(mlp, name, _resized_linear(layer, layer.in_features, width + extra))
    setattr(mlp, output, _resized_linear(getattr(mlp, output), width + extra, getattr(mlp, output).out_features))


def pad_mlps(blocks: Iterable[torch.nn.Module], multiple: int) -> None:
    """`pad_mlp` of each block's `mlp`, in place."""
    with torch.no_grad():
        for block in blocks:
            pad_mlp(block.mlp, multiple)


def _resized_linear(layer: torch.nn.Linear, in_features: int, out_features: int) -> torch.nn.Linear:
    """A copy of `layer` grown to the given sizes, new weights and bias entries zero."""
    weight = layer.weight
    grown = torch.nn.Linear(in_features, out_features, bias=layer.bias is not None, device=weight.device, dtype=weight.dtype)
    grown.requires_grad_(False)
    grown.weight.zero_()
    grown.weight[: layer.out_features, : layer.in_features] = weight
    if layer.bias is not None:
        grown.bias.zero_()
        grown.bias[: layer.out_features] = layer.bias
    return grown
