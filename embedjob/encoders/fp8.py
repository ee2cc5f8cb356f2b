"""Row-wise FP8 linear layers for the transformer blocks (`model.precision: fp8`).

The blocks' matrix products are most of a vision tower's time and run near the bf16
matmul rate already; FP8 (e4m3) products run at up to twice that rate on GPUs that have
them (Hopper and newer). Scales are per row on both sides: one per output channel of a
weight, quantised once at load, and one per token of an activation, computed at every
call, so an outlier token or channel costs only its own row's precision. Everything
else (patch embedding, attention, pooling heads, mergers) stays in the model's dtype:
they are a small share of the time and the most sensitive to precision; the blocks'
norms and MLP activations run in float32 inside the quantiser (below).

On CUDA an activation is quantised by one Triton kernel per call
(`torch.ops.embedjob.fp8_quantize_rows`, `encoders.fp8_kernel`), which reads each row
once. Left to the compiler, the quantisation fuses into the kernel that makes its input
(a norm, an activation) as a looped reduction that reads the row twice: on the
SigLIP-so400m-size tower the GELU and the scales of the down projection's input took
3.7 ms a block of a 186,624-token batch, against 1.0 ms for the GELU and 0.29 ms for the
row kernel's average call (benchmarks/RESULTS.md's git history).

Sibling layers that a block calls on one and the same input (`JOINT_GROUPS`: the
separate q, k and v projections of SigLIP, CLIP, DINOv2 and DINOv3, the gate and up
projections of the gated MLPs) share one quantisation of it and one product of their
joined weights (`Fp8Joint`; a sibling without a bias, as DINOv3's k, adds zeros): the first of them called on an input computes every sibling's output, the
others take their columns. On the SigLIP-so400m-size tower the row kernel's time fell
from 47 to 37 ms of the batch and the tower ran 4 % faster (benchmarks/RESULTS.md's git history).

An MLP's activation is applied by the layer that reads it (`ACTIVATION_INTO`: fc1, the
activation, fc2 in turn, as in SigLIP, CLIP, DINOv2 and Qwen2-VL, or DINOv3's up, act
and down): fc2 quantises the
activation of its input in the same kernel, so the activated hidden state, the widest
tensor of the block, is never written in bf16 and read back (SigLIP-so400m 3 %, CLIP-L
6 % faster). The activation is recognised by its values, not by its class name, which
transformers has changed between releases.

A block's norm is applied by the layers that read it (`NORM_INTO`: the layer norms or
RMS norms before attention and before the MLP in every family's block): the row kernel
normalises the row it holds anyway before it takes the row's scale, so the normalised
state is never written in bf16 and read back, and the norm's own kernel (a looped
reduction over rows wider than the compiler's 1,024-element limit) does not run.

A gated MLP (`GATED_MLPS`: `down(act(gate(x)) * up(x))` with a SiLU, as in Qwen2.5-VL)
becomes an `Fp8GatedMlp`: its gate and up projections stay one joined product, and the
down projection's row kernel reads that product's output rows itself, forms
`silu(gate) * up` in float32 and quantises it, so the gated hidden state is never written
in bf16 and read back, and the compiler's kernel that made it does not run. The
activation is recognised by its values, and at load the converted MLP must compute what
the MLP does on a probe input, else it stays as it was. On the Qwen2.5-VL-7B-size tower
FP8 ran 1.41x bf16 with it and 1.30x without (benchmarks/RESULTS.md).

Layers a job keeps in the model's dtype (`model.fp8_keep`, paths within a block) are left
as they are; joined siblings of a kept layer join without it, and a norm or activation
that a kept layer reads runs on its own. Every layer's FP8 product is about as far off,
whatever its size, but not every error reaches the vector alike: kept in every block,
the attention output projection (8-9 % of the products) brought the vectors closer to
float32 than any other kind (benchmarks/RESULTS.md section 6), while a layer costs
speed by its share of the products.

Invariants: a converted layer computes `x @ W.T + b` up to FP8 rounding, for any input
row count and any layer shape (the FP8 product needs both matrix dimensions multiples
of 16: weights are zero-padded once, inputs along their last dimension at each call);
an input row of zeros gives the bias. Both quantisers give one scale per row from the
row's largest magnitude and round the same way.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embedjob.config import JobError

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
ALIGN = 16
"""The FP8 product's alignment of both matrix dimensions (torch._scaled_mm)."""
_TINY = 1e-12
FAST_ACCUM = True
"""Whether new layers let the FP8 product accumulate at the tensor cores' own precision
(`use_fast_accum`), skipping the periodic promotion of partial sums to float32: on an
H200 the SigLIP-so400m-size tower's FP8 products took 121 ms of a batch with it and 154
without (bf16: 219), and the per-item cosine to bf16 did not move
(benchmarks/RESULTS.md). Read when a layer is made."""
ROW_KERNEL = True
"""Whether new layers quantise activations on CUDA with the Triton row kernel rather than
the compiler's fused reduction (see the module docstring). Read when a layer is made."""
ROW_WARPS: int | None = None
"""Warps per row of the row kernel for every row; None: `ROW_WARPS_BY_KIND`'s. Read at each launch."""
ROW_WARPS_BY_KIND = {"narrow": 1, "wide": 8, "activated": 4, "gated": 8}
"""Warps per row of the row kernel by the row's kind (`row_kind`), each held in `ROW_BLOCKS`
blocks: on an H100 (RESULTS.md section 6) these ran SigLIP-so400m-size FP8 1.24x bf16 and
the Qwen2.5-VL-7B-size tower at 224 px 1.41x, against 1.21x and 1.39x with 4 warps for
narrow and gated rows (`benchmarks/quantize_rows.py` alone: SigLIP's normed 1,152-column rows
297 us a call at 1 warp against 417 at 4, Qwen's gated 3,420-column rows 1,185 at 8 against
1,332). Before the blocks, 8 warps read plain 3,456-column rows 1.12x as fast as 4, and
with a GELU 4 were 1.14x faster on 4,304 and 4,096 columns. Several rows a program (a block
kernel, in git history) was slower at every width. Read at each launch."""
ROW_BLOCKS = 3
"""Most power-of-two blocks a row kernel's program holds its row in (`row_blocks`); 1:
one block of the next power of two over the row, as the kernel did until the blocks
came, which computes on up to twice the lanes the row has (SigLIP's 4,304 columns on
8,192) and needs registers for them. Read at each launch."""


JOINT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of sibling layers that the towers' blocks (transformers' modeling code) call on
one input tensor, joined by `convert_blocks` where all of a group are linear layers of
one input width. A group that a forward does not call that way still computes right
(see `Fp8Joint`), only without the saving."""


ACTIVATION_INTO = (("activation_fn", "fc2"), ("act", "fc2"), ("gelu", "c_proj"), ("act_fn", "down_proj"), ("act_fn", "linear_fc2"))
"""(activation, layer) names of MLPs whose forward feeds the activation's output to that
layer alone (transformers' modeling code; OpenCLIP's `nn.Sequential` MLPs where nothing
but identities stands between the two, `_feeds_alone`), so the layer may apply the
activation itself. A gated MLP (one with a `GATED_MLPS` gate layer) has these names too,
but its layer reads `act(gate) * up`: it is never one of these."""
ACTIVATIONS: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "gelu_tanh": (1, lambda x: F.gelu(x, approximate="tanh")),
    "gelu": (2, F.gelu),
    "quick_gelu": (3, lambda x: x * torch.sigmoid(1.702 * x)),
}
"""Activations an FP8 layer applies to its input before quantising it: name -> (the
row kernel's code for it, its float32 definition)."""


GATED_MLPS = (("gate_proj", "up_proj", "down_proj", "act_fn"),)  # Qwen2.5-VL
"""(gate, up, down, activation) names of MLPs whose forward (transformers' modeling code)
is `down(act(gate(x)) * up(x))`, so down may form its input from the joined gate|up
product's output itself (`Fp8GatedMlp`). Read when blocks are converted."""
GATED_TOLERANCE = 0.15
"""The largest relative error of an `Fp8GatedMlp` to the MLP it replaces on a probe input
(`_probe_error`) at which it is used: FP8 rounding of the hidden state and of down's
weight gives 0.035 to 0.04 on Qwen2.5-VL-7B-shaped MLPs of random weights (CPU, float32
and bfloat16); forwards other than `down(act(gate(x)) * up(x))` gave 0.65 and more (gate
and up swapped, no activation) and 0.33 (the hidden state times 1.5)."""
GATES: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {"silu": (4, F.silu)}
"""Activations a gated MLP's down projection applies to the gate half of its input row:
name -> (the row kernel's code for it, its float32 definition). Apart from `ACTIVATIONS`
because no ungated MLP has been checked with them."""


NORM_INTO = (
    ("layer_norm1", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),  # SigLIP, CLIP
    ("layer_norm2", ("mlp.fc1",)),  # SigLIP, CLIP
    ("norm1", ("attention.q_proj", "attention.k_proj", "attention.v_proj")),  # DINOv2
    ("norm1", ("attn.qkv",)),  # Qwen-VL
    ("norm2", ("mlp.fc1",)),  # DINOv2, Qwen2-VL
    ("norm2", ("mlp.up_proj",)),  # DINOv3 (its gated MLP is the next entry's)
    ("norm2", ("mlp.gate_proj", "mlp.up_proj")),  # Qwen2.5-VL
    ("ln_1", ("attn.qkv",)),  # OpenCLIP's image blocks (open_clip.BatchFirstAttention)
    ("ln_2", ("mlp.c_fc",)),  # OpenCLIP
    ("norm2", ("mlp.linear_fc1",)),  # Qwen3-VL, Qwen3.5
)
"""(norm, the layers that read its output) by their names within a block, for blocks
whose forward (transformers' modeling code) hands the norm's output to those layers
alone, so they may apply the norm themselves."""
NORMS = {"layer_norm": 1, "rms_norm": 2}
"""Norms an FP8 layer applies to its input before quantising it: name -> the row kernel's code."""


@dataclass(frozen=True)
class Norm:
    """A block's norm as an FP8 layer applies it: `kind` of `NORMS`, per-column weight
    (and bias for a layer norm), epsilon."""

    kind: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of `x` (rows, width) in float32."""
        x = x.float()
        if self.kind == "layer_norm":
            bias = None if self.bias is None else self.bias.float()
            return F.layer_norm(x, (x.shape[-1],), self.weight.float(), bias, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def recognised_norm(module: torch.nn.Module, width: int) -> Norm | None:
    """`module` as a `Norm` over `width` columns, where it is a layer norm or an RMS norm
    (checked by its values on random rows against `Norm`'s), or None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (width,):
        return None
    if isinstance(module, torch.nn.LayerNorm):
        norm = Norm("layer_norm", weight.detach(), None if module.bias is None else module.bias.detach(), module.eps)
    else:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not isinstance(eps, float) or getattr(module, "bias", None) is not None:
            return None
        norm = Norm("rms_norm", weight.detach(), None, eps)
    probe = torch.randn(8, width, generator=torch.Generator().manual_seed(0)).to(weight.device) * 3 + 1
    try:
        with torch.no_grad():
            values = module(probe.to(weight.dtype)).float()
    except (RuntimeError, TypeError):
        return None
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return norm if torch.allclose(values, norm(probe), rtol=tolerance, atol=tolerance) else None


def recognised_activation(
    module: torch.nn.Module, among: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = ACTIVATIONS
) -> str | None:
    """The name in `among` (`ACTIVATIONS` or `GATES`) of what `module` computes, from its
    values in float32 on [-8, 8], or None (then it stays a module of its own)."""
    probe = torch.linspace(-8, 8, 1601)
    try:
        with torch.no_grad():
            values = module(probe)
    except (RuntimeError, TypeError):
        return None
    for name, (_, function) in among.items():
        if values.shape == probe.shape and torch.allclose(values, function(probe), rtol=1e-4, atol=1e-5):
            return name
    return None


def _padded(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def row_kind(padded: int, activation: int, up: int) -> str:
    """What `ROW_WARPS_BY_KIND` calls a row the kernel quantises: "gated" (a joined gate|up
    row, `up` > 0), "activated" (an `ACTIVATIONS` code), else "narrow" up to 2,048 columns
    and "wide" past them (a norm or nothing before the scale)."""
    if up > 0:
        return "gated"
    if activation:
        return "activated"
    return "narrow" if padded <= 2048 else "wide"


def row_blocks(padded: int, most: int) -> tuple[int, int, int]:
    """The widths (powers of two, largest first, 0 for none) of the at most `most` (1 to
    3) blocks that the row kernel holds a row of `padded` columns in: `padded`'s binary
    digits from the top, the last block rounded up to the next power of two over what
    is left, so the blocks cover `padded` with the fewest lanes that many blocks allow."""
    widths = []
    left = padded
    while left > 0 and len(widths) < most - 1:
        widths.append(1 << (left.bit_length() - 1))
        left -= widths[-1]
    if left > 0:
        widths.append(1 << (left - 1).bit_length())
    return (*widths, *[0] * (3 - len(widths)))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (rows, k) as FP8 with one float32 scale per row: x ~= q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_TINY) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


InputProducts = Mapping[torch.nn.Module, torch.Tensor]
"""A linear layer's input product: the sum of x^T x (float32, in x in) over the input
rows it was called on, by layer (`input_products`)."""
CALIBRATION_DAMPING = 0.01
"""What `calibrated_rows` adds to the input product's diagonal, as a share of its mean:
enough to invert a product of fewer rows than columns, too little to move the result."""
CALIBRATION_BLOCK = 128
"""Columns `calibrated_rows` rounds between two updates of the columns after them: the
carried error reaches the rest as one product per block, not a rank-one update per column."""


def calibrated_rows(weight: torch.Tensor, product: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (n, k) as FP8 with `quantize_rows`' scales, rounded one input column at a
    time, each column's rounding error carried into the columns not yet rounded as the
    inverse of `product` (the layer's input product, k x k) weighs it, so that on inputs
    like those the layer's output moves least: the error feedback of GPTQ (Frantar et al.,
    2022) on FP8's grid. On the Qwen2.5-VL-7B-size and SigLIP-so400m-size towers, rounded
    this way on 16 photos, the lowest cosine to float32 over other photos rose from
    0.9946 to 0.9985 and from 0.9941 to 0.9992 (benchmarks/RESULTS.md section 6).

    Invariants: the scales are those of `quantize_rows(weight)`, so a layer takes these
    rows wherever it takes those; a column whose inputs were all zero carries nothing and
    is rounded to nearest; a product that cannot be inverted even damped (NaN in the
    inputs) gives `quantize_rows(weight)` itself, with a warning."""
    w = weight.detach().float().clone()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    h = product.to(w.device, torch.float64).clone()
    idle = h.diagonal() == 0
    h[idle, idle] = 1.0
    h.diagonal().add_(CALIBRATION_DAMPING * h.diagonal().mean())
    lower, info = torch.linalg.cholesky_ex(h)
    if info.item() == 0:
        upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    if info.item() != 0:
        logger.warning("model.fp8_calibrate: a layer's input product cannot be inverted; its weight is rounded to nearest")
        return quantize_rows(weight)
    upper = upper.float()
    quantized = torch.empty(w.shape, dtype=FP8, device=w.device)
    for start in range(0, w.shape[1], CALIBRATION_BLOCK):
        stop = min(start + CALIBRATION_BLOCK, w.shape[1])
        part, errors = w[:, start:stop], torch.empty(w.shape[0], stop - start, device=w.device)
        for i in range(stop - start):
            column = part[:, i : i + 1]
            q = (column / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            quantized[:, start + i : start + i + 1] = q
            errors[:, i : i + 1] = (column - q.float() * scale) / upper[start + i, start + i]
            part[:, i:] -= errors[:, i : i + 1] * upper[start + i, start + i : stop]
        w[:, stop:] -= errors @ upper[start:stop, stop:]
    return quantized, scale


@contextmanager
def input_products(
    blocks: Iterable[torch.nn.Module], keep: Collection[str] = ()
) -> Iterator[dict[torch.nn.Module, torch.Tensor]]:
    """While inside, every `nn.Linear` of `blocks` but those at the paths `keep` (which
    stay out of FP8, `convert_blocks`) adds x^T x of its input rows (float32, on their
    device) to the dict this yields, by layer: what `calibrated_rows` weighs rounding
    errors by. Siblings called on one tensor (q, k and v) share its product.
    What a layer reads is its input as the block computes it (after its norm and
    activation), which is what an FP8 layer that applies them quantises."""
    products: dict[torch.nn.Module, torch.Tensor] = {}
    latest: list[torch.Tensor | None] = [None, None]  # the last input tensor and its product

    def add(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0]
        if latest[0] is not x:
            rows = x.reshape(-1, x.shape[-1]).float()
            latest[0], latest[1] = x, rows.T @ rows
        products[module] = products[module] + latest[1] if module in products else latest[1].clone()

    layers = [m for block in blocks for path, m in block.named_modules() if type(m) is torch.nn.Linear and path not in keep]
    handles = [layer.register_forward_pre_hook(add) for layer in layers]
    try:
        yield products
    finally:
        for handle in handles:
            handle.remove()
        latest.clear()


def _quantize_padded(rows: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of `rows` zero-padded to `padded` columns (the torch path of the row kernel)."""
    return quantize_rows(rows if rows.shape[1] == padded else F.pad(rows, (0, padded - rows.shape[1])))


def quantize_input(
    rows: torch.Tensor, padded: int, cols: int, kernel: bool, *, activation: str | None = None, norm: Norm | None = None,
    gate: str | None = None, up: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What an FP8 layer quantises of its input `rows` (`quantize_rows`, zero-padded to
    `padded` columns): the first `cols` columns after `norm`, then the `ACTIVATIONS`
    `activation`; or, with a `GATES` `gate`, a joined gate|up row's `gate(x[:, :cols]) *
    x[:, up:up + cols]`. The row kernel runs it where `kernel` and the rows are on CUDA
    (one pass over each row), torch elsewhere; both give the same rows up to rounding."""
    if kernel and rows.is_cuda:
        if gate is not None:
            return torch.ops.embedjob.fp8_quantize_rows(rows, padded, cols, up, GATES[gate][0], 0, None, None, 0.0)
        code = 0 if activation is None else ACTIVATIONS[activation][0]
        if norm is None:
            return torch.ops.embedjob.fp8_quantize_rows(rows, padded, cols, 0, code, 0, None, None, 0.0)
        return torch.ops.embedjob.fp8_quantize_rows(rows, padded, cols, 0, code, NORMS[norm.kind], norm.weight, norm.bias, norm.eps)
    if gate is not None:
        return _quantize_padded(GATES[gate][1](rows[:, :cols].float()) * rows[:, up : up + cols].float(), padded)
    if norm is not None:
        rows = norm(rows)
    if activation is not None:
        rows = ACTIVATIONS[activation][1](rows.float())
    return _quantize_padded(rows, padded)


@functools.cache
def _register_row_quantizer() -> None:
    """Registers `torch.ops.embedjob.fp8_quantize_rows(x, padded, cols, up, activation, norm,
    weight, bias, eps)`: `quantize_rows` of the first `cols` columns of each row of a CUDA
    tensor `x` (rows, >= cols), after the norm of that `NORMS` code (0: none; its weight,
    bias and epsilon) and the activation of that `ACTIVATIONS` code (0: none), as one
    Triton kernel, zero-padded to `padded` columns; one program per row holds the whole
    row, so it is read once. With `up` > 0 (a multiple of 16, at least `cols`), the row
    is a joined gate|up product's and what is quantised is `act(x[:, :cols]) *
    x[:, up:up + cols]` in float32, `act` the `GATES` code `activation`, with no norm.
    A `torch.library.triton_op`, so compiled blocks call the kernel and CUDA graphs
    capture it, and its fake implementation is this function traced on fake tensors;
    registered once, when the first layer is made (Triton is imported only where CUDA runs)."""
    from embedjob.encoders.fp8_kernel import fp8_quantize_rows_kernel

    @torch.library.triton_op("embedjob::fp8_quantize_rows", mutates_args=())
    def quantize(
        x: torch.Tensor, padded: int, cols: int, up: int, activation: int, norm: int,
        weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if up + cols > x.shape[1]:  # the kernel would read past the row
            raise ValueError(f"fp8_quantize_rows: columns up to {up + cols} asked of rows of {x.shape[1]}")
        x = x if x.stride(-1) == 1 else x.contiguous()
        rows = x.shape[0]
        quantized = torch.empty(rows, padded, dtype=FP8, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        warps = ROW_WARPS or ROW_WARPS_BY_KIND[row_kind(padded, activation, up)]
        head, mid, tail = row_blocks(padded, ROW_BLOCKS)
        weight = x if weight is None else weight  # not read without a norm
        bias = weight if bias is None else bias  # not read without a layer norm
        torch.library.wrap_triton(fp8_quantize_rows_kernel)[(rows,)](
            x, quantized, scale, weight, bias, x.stride(0), cols, padded, up,
            HEAD=head, MID=mid, TAIL=tail, TINY=_TINY, LIMIT=FP8_MAX, ACTIVATION=activation, NORM=norm, EPS=eps,
            GATED=up > 0, num_warps=warps,
        )
        return quantized, scale


class Fp8Linear(torch.nn.Module):
    """An `nn.Linear` whose product runs in row-wise FP8 (see the module docstring);
    its output is in the input's dtype. Given several layers of one input width, it
    is their joined product: its output holds each layer's columns in turn, each
    starting at a multiple of 16 (`starts`). Given an `ACTIVATIONS` name, it computes
    the layer of that activation of its input; after `apply_norm`, of its input's norm
    (then the activation). `gated` computes the layer of a gated MLP's hidden state
    from the joined gate|up product's output. Given `inputs` (`input_products`) that
    hold its layers' input product, its weight is rounded by `calibrated_rows`, else
    to nearest (`quantize_rows`); siblings read one input, so the first layer's serves all."""

    def __init__(
        self, linear: torch.nn.Linear | Sequence[torch.nn.Linear], activation: str | None = None,
        inputs: InputProducts | None = None,
    ) -> None:
        super().__init__()
        layers = [linear] if isinstance(linear, torch.nn.Linear) else list(linear)
        self.activation = activation
        self.in_features = layers[0].in_features
        self.widths = [layer.out_features for layer in layers]
        self.starts = [sum(_padded(w) for w in self.widths[:i]) for i in range(len(layers))]
        self.out_features = self.starts[-1] + self.widths[-1]
        self.fast_accum = FAST_ACCUM
        self.row_kernel = ROW_KERNEL and torch.cuda.is_available()
        if self.row_kernel:
            _register_row_quantizer()
        k = _padded(self.in_features)
        weight = torch.cat(
            [F.pad(layer.weight.detach().float(), (0, k - self.in_features, 0, _padded(layer.out_features) - layer.out_features))
             for layer in layers]
        )
        product = None if inputs is None else inputs.get(layers[0])
        if product is None:
            quantized, scale = quantize_rows(weight)
        else:
            quantized, scale = calibrated_rows(weight, F.pad(product, (0, k - self.in_features, 0, k - self.in_features)))
        self.register_buffer("weight", quantized)  # (n, k): its transpose is the column-major operand
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())
        # A layer without a bias among biased ones adds zeros: x @ W.T + 0 is its output.
        biases = [
            layer.bias.detach() if layer.bias is not None else layer.weight.new_zeros(layer.out_features) for layer in layers
        ]
        self.register_buffer(
            "bias",
            None if all(layer.bias is None for layer in layers) else torch.cat(
                [F.pad(bias, (0, _padded(bias.shape[0]) - bias.shape[0])) for bias in biases]
            ).to(layers[0].weight.dtype),
        )
        self.norm: Norm | None = None

    def apply_norm(self, norm: Norm) -> None:
        """From now on normalise the input by `norm` before anything else."""
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        quantized, scale = quantize_input(
            rows, self.weight.shape[1], self.in_features, self.row_kernel, activation=self.activation, norm=self.norm
        )
        return self._product(quantized, scale, x)

    def gated(self, x: torch.Tensor, activation: str, up: int) -> torch.Tensor:
        """The layer of `act(gate) * up` where `x` (..., >= up + in_features) holds a gated
        MLP's gate in columns [0, in_features) and its up half from column `up` (a
        multiple of 16), `act` the `GATES` activation: the hidden state is formed in
        float32 as the row is quantised, never in `x`'s dtype. No norm or activation of
        the layer's own applies (a gated MLP's norm comes before its gate and up)."""
        rows = x.reshape(-1, x.shape[-1])
        quantized, scale = quantize_input(rows, self.weight.shape[1], self.in_features, self.row_kernel, gate=activation, up=up)
        return self._product(quantized, scale, x)

    def _product(self, quantized: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The FP8 product of the quantised rows of `x` with the weight, in `x`'s dtype and
        leading shape, without the weight's padded output columns."""
        out = torch._scaled_mm(
            quantized,
            self.weight.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=x.dtype,
            use_fast_accum=self.fast_accum,
        )
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        norm = "" if self.norm is None else f", norm={self.norm.kind}"
        activation = "" if self.activation is None else f", activation={self.activation}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=row-wise{norm}{activation}"


class _Shared:
    """The joined product's latest input and output, until every sibling has taken its
    columns: a plain object, so the compiler traces its updates as side effects of the
    block and nothing outlives the block's call."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.taken = 0


class Fp8Joint(torch.nn.Module):
    """One of sibling layers joined into one FP8 product (`JOINT_GROUPS`): it returns
    its own layer's output, computing the product only when its input is not the one
    the last product was computed from.

    Invariants: the output equals `Fp8Linear(layer)(x)` up to the product's rounding
    whatever order, inputs and number of calls the siblings see (an input that is not
    the remembered tensor gets its own product); once every sibling has taken its
    columns of a product the remembered tensors are dropped, so none is held between
    the block's calls.
    """

    def __init__(self, product: Fp8Linear, index: int, shared: _Shared) -> None:
        super().__init__()
        self.product = product
        self.in_features, self.out_features = product.in_features, product.widths[index]
        self.start = product.starts[index]
        self.siblings = len(product.widths)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared
        if shared.input is not x:
            shared.input, shared.output, shared.taken = x, self.product(x), 0
        out = shared.output[..., self.start : self.start + self.out_features]
        shared.taken += 1
        if shared.taken == self.siblings:
            shared.input = shared.output = None
        return out


class Fp8GatedMlp(torch.nn.Module):
    """A gated MLP `down(act(gate(x)) * up(x))` (`GATED_MLPS`) as two FP8 products: the
    joined gate|up product once, then down's, which forms `act(gate) * up` from the
    joined output's rows as it quantises them (`Fp8Linear.gated`).

    The MLP's layers keep their names and modules (gate and up the `Fp8Joint`s of the
    joined product, down an `Fp8Linear`), so the norm that the product applies
    (`NORM_INTO`) and the counts of FP8 layers find them as before; the activation module
    is gone, `activation` of `GATES` standing for it.

    Invariants: the output equals the MLP's up to FP8 rounding and the hidden state's
    forming in float32 rather than the MLP's dtype (checked on a probe at load,
    `_gate_into`); gate and up called on their own still give their own outputs."""

    def __init__(self, names: Sequence[str], gate: Fp8Joint, up: Fp8Joint, down: Fp8Linear, activation: str) -> None:
        super().__init__()
        self.names = tuple(names)  # gate, up, down
        for name, layer in zip(self.names, (gate, up, down)):
            setattr(self, name, layer)
        self.activation = activation
        self.up_start = up.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = getattr(self, self.names[0]).product(x)
        return getattr(self, self.names[2]).gated(joined, self.activation, self.up_start)

    def extra_repr(self) -> str:
        return f"activation={self.activation}, up from column {self.up_start} of the joined product"


def check_fp8(device: torch.device, dtype: torch.dtype) -> None:
    """A JobError when this device cannot run the FP8 product into `dtype`: one tiny
    product is tried, since which GPUs, dtypes and scalings torch supports changes
    between releases (row-wise scaling needs Hopper or newer and bfloat16 output on CUDA)."""
    try:
        x = torch.ones(ALIGN, ALIGN, device=device, dtype=dtype)
        Fp8Linear(torch.nn.Linear(ALIGN, ALIGN, device=device, dtype=dtype))(x)
    except (RuntimeError, NotImplementedError, TypeError, ImportError) as exc:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise JobError(
            f"model.precision: fp8 cannot run on {name} with model.dtype {str(dtype).removeprefix('torch.')} "
            f"({reason}); it needs a GPU of compute capability 9.0 or newer (H100, H200, B200) and model.dtype: "
            "bfloat16; set model.precision: bf16"
        ) from None


def convert_blocks(
    blocks: Iterable[torch.nn.Module], keep: Collection[str] = (), inputs: InputProducts | None = None
) -> Counter[str]:
    """Replace every `nn.Linear` inside `blocks` by its FP8 layer, in place, the siblings
    of a `JOINT_GROUPS` group by `Fp8Joint`s of one product and a `GATED_MLPS` MLP of
    joined siblings by an `Fp8GatedMlp`; how many of each (name relative to its block,
    e.g. `mlp.down_proj`) were converted. The linear layers at the paths `keep` stay as
    they are; a JobError, before any change, where one of them is no linear layer of a
    block. With `inputs` (`input_products` of these blocks), each layer whose input
    product it holds is rounded by `calibrated_rows`."""
    blocks = list(blocks)
    check_kept(blocks, keep)
    converted: Counter[str] = Counter()
    joined: Counter[tuple[str, ...]] = Counter()
    activated: Counter[tuple[str, str, str]] = Counter()
    gated: Counter[tuple[tuple[str, ...], str]] = Counter()
    normed: Counter[tuple[str, tuple[str, ...], str]] = Counter()
    for block in blocks:
        for name, module in list(block.named_modules()):
            prefix = f"{name}." if name else ""
            for group in JOINT_GROUPS:
                members = [member for member in group if prefix + member not in keep]
                if len(members) > 1 and _join(module, members, inputs):
                    joined[tuple(prefix + member for member in members)] += 1
                    converted.update(prefix + member for member in members)
            for pair in ACTIVATION_INTO:
                activation = None if prefix + pair[1] in keep else _activate_into(module, *pair, inputs)
                if activation is not None:
                    activated[prefix + pair[0], prefix + pair[1], activation] += 1
                    converted[prefix + pair[1]] += 1
            replacement = _gate_into(block, name, module, keep, inputs)
            if replacement is not None:
                gated[tuple(prefix + member for member in replacement.names), replacement.activation] += 1
                converted[prefix + replacement.names[2]] += 1
                continue  # `module` is replaced; its down layer is the replacement's, in FP8
            for child_name, child in list(module.named_children()):
                if type(child) is torch.nn.Linear and prefix + child_name not in keep:
                    setattr(module, child_name, Fp8Linear(child, inputs=inputs))
                    converted[prefix + child_name] += 1
        for norm_name, readers in NORM_INTO:
            kind = _norm_into(block, norm_name, readers)
            if kind is not None:
                normed[norm_name, readers, kind] += 1
    for group, count in joined.items():
        logger.info("model.precision fp8: %s share one quantisation and product in %d blocks", ", ".join(group), count)
    for (activation, layer, kind), count in activated.items():
        logger.info("model.precision fp8: %s applies %s (%s) as it quantises, in %d blocks", layer, activation, kind, count)
    for ((gate, up, down), kind), count in gated.items():
        logger.info(
            "model.precision fp8: %s forms %s(%s) * %s from their joined product as it quantises, in %d blocks",
            down, kind, gate, up, count,
        )
    for (norm_name, readers, kind), count in normed.items():
        logger.info("model.precision fp8: %s apply %s (%s) as they quantise, in %d blocks", ", ".join(readers), norm_name, kind, count)
    if keep:
        logger.info("model.precision fp8: %s stay in the model dtype (model.fp8_keep)", ", ".join(sorted(keep)))
    return converted


def check_kept(blocks: list[torch.nn.Module], keep: Collection[str]) -> None:
    """A JobError naming the paths of `keep` that are no linear layer of any block (e.g.
    `mlp.fc2`), and those that are."""
    paths = {name for block in blocks for name, module in block.named_modules() if type(module) is torch.nn.Linear}
    unknown = sorted(set(keep) - paths)
    if unknown:
        raise JobError(
            f"model.fp8_keep names {', '.join(unknown)}, which no block of this tower has as a linear layer; "
            f"its blocks' linear layers are: {', '.join(sorted(paths)) or 'none'}"
        )


def _norm_into(block: torch.nn.Module, norm_name: str, readers: Sequence[str]) -> str | None:
    """Where `block` has a recognised norm at `norm_name` and FP8 layers at every one of
    `readers` (a joined product only with all its siblings among them), make the layers
    apply the norm and the norm an identity; the norm's kind, or None where nothing changed."""
    norm_module = _submodule(block, norm_name)
    layers = [_submodule(block, path) for path in readers]
    if norm_module is None or not all(isinstance(layer, (Fp8Linear, Fp8Joint)) for layer in layers):
        return None
    products = {id(p): p for p in (layer.product if isinstance(layer, Fp8Joint) else layer for layer in layers)}
    joints = [layer for layer in layers if isinstance(layer, Fp8Joint)]
    if any(sum(other.shared is joint.shared for other in joints) != joint.siblings for joint in joints):
        return None
    widths = {product.in_features for product in products.values()}
    norm = recognised_norm(norm_module, widths.pop()) if len(widths) == 1 else None
    if norm is None or any(product.norm is not None or product.activation is not None for product in products.values()):
        return None
    for product in products.values():
        product.apply_norm(norm)
    parent, _, name = norm_name.rpartition(".")
    setattr(block.get_submodule(parent) if parent else block, name, torch.nn.Identity())
    return norm.kind


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _activate_into(module: torch.nn.Module, activation: str, layer: str, inputs: InputProducts | None) -> str | None:
    """Where `module` has the linear `layer` and a recognised activation under
    `activation`, make the layer an FP8 one that applies it and the activation an
    identity; the activation's `ACTIVATIONS` name, or None where nothing changed."""
    linear, function = getattr(module, layer, None), getattr(module, activation, None)
    if type(linear) is not torch.nn.Linear or not isinstance(function, torch.nn.Module):
        return None
    if any(getattr(module, names[0], None) is not None for names in GATED_MLPS) or not _feeds_alone(module, activation, layer):
        return None
    kind = recognised_activation(function)
    if kind is None:
        return None
    setattr(module, layer, Fp8Linear(linear, activation=kind, inputs=inputs))
    setattr(module, activation, torch.nn.Identity())
    return kind


def _feeds_alone(module: torch.nn.Module, activation: str, layer: str) -> bool:
    """Whether `module` hands `activation`'s output to `layer` alone: in an `nn.Sequential`
    (OpenCLIP's MLPs) where the layer follows the activation with nothing but identities
    between (OpenCLIP's `scale_fc` blocks put a norm there); any other module by the names
    `ACTIVATION_INTO` lists for its forward."""
    if not isinstance(module, torch.nn.Sequential):
        return True
    names = [name for name, _ in module.named_children()]
    first, last = names.index(activation), names.index(layer)
    return first < last and all(isinstance(getattr(module, name), torch.nn.Identity) for name in names[first + 1 : last])


def _gate_into(
    block: torch.nn.Module, path: str, mlp: torch.nn.Module, keep: Collection[str], inputs: InputProducts | None
) -> Fp8GatedMlp | None:
    """Where `mlp`, at `path` in `block`, is an MLP of `GATED_MLPS` names with its gate
    and up `Fp8Joint`s of one product of the two (gate first), a linear down layer of
    their width that `keep` does not name and a `GATES` activation (by its values), and
    on a probe input its `Fp8GatedMlp` computes what it computes, replace it by that and
    return it; None where nothing changed. Never the block itself, which has no parent
    here to hold the replacement."""
    for names in GATED_MLPS if path else ():
        if f"{path}.{names[2]}" in keep:
            continue
        gate, up, down, function = (getattr(mlp, name, None) for name in names)
        if not (isinstance(gate, Fp8Joint) and isinstance(up, Fp8Joint) and type(down) is torch.nn.Linear):
            continue
        if gate.shared is not up.shared or gate.siblings != 2 or gate.start != 0 or up.start == 0:
            continue
        activation = recognised_activation(function, GATES) if isinstance(function, torch.nn.Module) else None
        if activation is None or not gate.out_features == up.out_features == down.in_features:
            continue
        replacement = Fp8GatedMlp(names[:3], gate, up, Fp8Linear(down, inputs=inputs), activation)
        error = _probe_error(mlp, replacement, gate.in_features, down.weight)
        if not error <= GATED_TOLERANCE:  # NaN too
            logger.warning(
                "model.precision fp8: %s does not compute %s(%s(%s(x)) * %s(x)) on a probe (its gated FP8 form is %.3g off, "
                "relative); its hidden state stays a tensor of its own", path, names[2], activation, names[0], names[1], error,
            )
            continue
        parent, _, name = path.rpartition(".")
        setattr(block.get_submodule(parent) if parent else block, name, replacement)
        return replacement
    return None


def _probe_error(mlp: torch.nn.Module, replacement: torch.nn.Module, width: int, like: torch.Tensor) -> float:
    """The largest relative error `|got - want| / |want|` over random rows of `width`
    columns (in `like`'s dtype and on its device) of `replacement`'s output to `mlp`'s;
    infinite where `mlp` cannot take them. The MLP's own forward is the reference, so a
    forward other than its layers' names suggest is caught whatever transformers' code
    does; a relative error, not a cosine, so a forward that scales the result is too."""
    probe = torch.randn(16, width, generator=torch.Generator().manual_seed(0)).to(like.device, like.dtype)
    with torch.no_grad():
        got = replacement(probe).float()
        try:
            want = mlp(probe)
        except (RuntimeError, TypeError):
            return float("inf")
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return float("inf")
    want = want.float()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=_TINY)).max())


def _join(module: torch.nn.Module, group: Sequence[str], inputs: InputProducts | None) -> bool:
    """Replace `module`'s linear layers named `group` by `Fp8Joint`s of one product,
    where it has them all, of one input width."""
    layers = [getattr(module, member, None) for member in group]
    if not all(type(layer) is torch.nn.Linear for layer in layers):
        return False
    if len({layer.in_features for layer in layers}) != 1:
        return False
    product, shared = Fp8Linear(layers, inputs=inputs), _Shared()
    for index, member in enumerate(group):
        setattr(module, member, Fp8Joint(product, index, shared))
    return True
