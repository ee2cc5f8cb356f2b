"""Text towers beside image towers: captions and zero-shot label prompts as token ids.

A family whose full checkpoints carry a text tower (`registry.Family.text`) builds a
`TextAdapter` from the loaded full model in its own module (`fixed.build_text` for the
transformers dual encoders, `open_clip.build_text` with OpenCLIP's own tokenizer):
which submodules make the caption's vector, and how its captions are padded. Everything
else is here, the same for every family: the checkpoint's tokenizer, the picklable
`TextPreprocessor` the decode workers run (OpenCLIP's subclass tokenises with OpenCLIP's
own tokenizer), and the adapter the graph engine runs.

What the numbers mean (the contract the packer, the graph manager and the pipeline rely on):
- An item is one caption: exactly `length` token ids (the model's length: its
  `max_position_embeddings`, OpenCLIP's `context_length`), truncated by the tokenizer
  as the model's documentation does and padded to `length`. Its `tokens` is `length`,
  so budgets are multiples of `length` (`budget_unit`) and a budget of B tokens is a
  batch of B // length captions: one captured graph per batch size at the fixed length.
- `forward` returns one row per caption: the text tower's projected vector, what the
  full model's `get_text_features(...).pooler_output` (OpenCLIP's `encode_text`) gives
  for the tokenizer's output, in the image vectors' space. Captions never attend to
  each other, so pad rows (all zero ids) cannot change a real row.
- Padding never moves the position a tower pools: CLIP-like towers (causal attention,
  pooled at the first EOS) are padded on the right with the tokenizer's pad id (its EOS
  where it has none), which no earlier position attends to, so no attention mask is
  needed; SigLIP-like towers (pooled at the last position) are padded by their tokenizer
  to `max_length`, which is how they were trained and what their documentation requires.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embedjob.encoders.base import EncoderAdapter, EncoderInput, NamedSpec, Placement, StaticInputs


IDS_KEY = "input_ids"
MAX_TEXTS_PER_BATCH = 256
"""The most captions in one batch: the largest budget is this many captions."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A checkpoint holds a tokenizer when it has one of these (transformers' loader would
otherwise make an empty one from the model's type without a word)."""


@functools.lru_cache(maxsize=4)
def load_tokenizer(directory: str) -> Any:
    """The checkpoint's own tokenizer (transformers' `AutoTokenizer`), loaded once per
    process (a decode worker loads it at its first caption). A ValueError in one line
    where there is none, or where it needs a library that is missing."""
    if not has_tokenizer(directory):
        raise ValueError(
            f"checkpoint {directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)}), which captions and labels need; "
            "save the model's tokenizer beside it (tokenizer.save_pretrained(directory))"
        )
    from transformers import AutoTokenizer

    return load_in_one_line(directory, lambda: AutoTokenizer.from_pretrained(directory), "sentencepiece")


def has_tokenizer(directory: str) -> bool:
    """Whether the checkpoint directory holds a saved tokenizer (`TOKENIZER_FILES`)."""
    return any((Path(directory) / name).exists() for name in TOKENIZER_FILES)


def load_in_one_line(directory: str, load: Callable[[], Any], library: str) -> Any:
    """`load()` of the tokenizer of `directory`, its failure a one-line ValueError: a
    missing library (`library` where the error names none) says what to install."""
    try:
        return load()
    except ImportError as exc:
        missing = getattr(exc, "name", None) or library
        raise ValueError(f"the tokenizer of {directory} needs {missing}: pip install 'embedjob[captions]'") from None
    except (OSError, ValueError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"cannot load the tokenizer of {directory}: {first}") from None


@dataclass(frozen=True)
class TextPreprocessor:
    """A caption -> its item of `length` token ids; picklable, run in decode workers.

    `pad_with` None: the tokenizer pads to `length` itself (`padding="max_length"`, its
    own pad token and side); an id: the ids are padded on the right with it."""

    directory: str
    length: int
    pad_with: int | None

    def __call__(self, text: str) -> EncoderInput:
        ids = torch.tensor([self.ids(text)], dtype=torch.int32)
        return EncoderInput({IDS_KEY: ids}, tokens=self.length, frames=0, size=self.length, modality="text")

    def ids(self, text: str) -> list[int]:
        """The caption's `length` token ids, as the model's documentation tokenises it."""
        tokenizer = load_tokenizer(self.directory)
        if self.pad_with is None:
            ids = tokenizer(text, padding="max_length", truncation=True, max_length=self.length)["input_ids"]
        else:
            ids = tokenizer(text, truncation=True, max_length=self.length)["input_ids"]
            ids = ids + [self.pad_with] * (self.length - len(ids))
        if len(ids) != self.length:
            raise ValueError(f"the tokenizer gave {len(ids)} ids for a caption of the model's length {self.length}")
        return ids


class PooledText(torch.nn.Module):
    """A transformers text model whose `pooler_output` is the caption's vector, then the
    projection where the family keeps it outside that model (CLIP's `text_projection`;
    SigLIP's head is inside its text model): what `get_text_features` computes."""

    def __init__(self, model: torch.nn.Module, projection: torch.nn.Module | None) -> None:
        super().__init__()
        self.model = model
        self.projection = projection

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.model(input_ids=ids).pooler_output
        return pooled if self.projection is None else self.projection(pooled)


class TextAdapter(EncoderAdapter):
    """A text tower run on batches of captions of one length (see the module docstring).

    `tower` maps (n, length) int64 ids to (n, width) vectors; `blocks` are its repeated
    modules (what `batching.compile` compiles, and where epilogues apply). `compiles`:
    whether `batching.compile` compiles them too: only towers whose attention takes no mask
    (SigLIP, SigLIP 2, `attention.register_unmasked`), so that warm-up and capture trace
    the same blocks; their compiled graphs replay like eager on an H100. CLIP's compiled
    causal blocks invalidated the capture there (`cudaErrorStreamCaptureInvalidated`, cause
    not found), so causal towers stay uncompiled."""

    def __init__(
        self,
        family: str,
        tower: torch.nn.Module,
        blocks: Sequence[torch.nn.Module],
        width: int,
        processing: TextPreprocessor,
        placement: Placement,
        compiles: bool = False,
    ) -> None:
        super().__init__(NamedSpec(family), processing, placement)
        self.tower = tower
        self.blocks = list(blocks)
        self.compiles = compiles
        self.length = processing.length
        self.embed_dim = width
        self.budget_unit = self.min_budget = self.length
        self.max_budget = self.length * MAX_TEXTS_PER_BATCH

    def preprocessor(self) -> TextPreprocessor:
        return self.processing

    def compile_units(self) -> list[torch.nn.Module]:
        return self.blocks

    def static_inputs(self, budget: int, max_items: int, max_frames: int) -> StaticInputs:
        """budget // length captions of zero ids (a valid dummy batch)."""
        count = budget // self.length
        if count < 1:
            raise ValueError(f"token budget {budget} is smaller than one caption ({self.length} tokens)")
        return StaticInputs({IDS_KEY: torch.zeros(count, self.length, dtype=torch.int32, device=self.device)}, constants={"budget": budget})

    def batch_values(self, items: list[EncoderInput], static: StaticInputs) -> dict[str, torch.Tensor]:
        return {IDS_KEY: self._joined(items)}

    def eager_inputs(self, items: list[EncoderInput]) -> StaticInputs:
        return StaticInputs({IDS_KEY: self._joined(items).to(self.device, non_blocking=True)})

    def forward(self, inputs: StaticInputs) -> torch.Tensor:
        """(n, length) int32 ids -> (n, width): one vector per caption, in input order."""
        return self.tower(inputs.tensors[IDS_KEY].long())

    def row_counts(self, items: list[EncoderInput]) -> list[int]:
        return [1] * len(items)

    def embed(self, texts: list[str]) -> torch.Tensor:
        """`texts` tokenised here and run eagerly: (len(texts), width) float32 on the
        device. For a few fixed prompts (`output.labels`), embedded once."""
        with torch.inference_mode():
            return self.forward(self.eager_inputs([self.processing(text) for text in texts])).float()

    def _joined(self, items: list[EncoderInput]) -> torch.Tensor:
        """Every item's ids in one new tensor (one `cat`), page-locked where it feeds a GPU."""
        out = torch.empty((len(items), self.length), dtype=torch.int32, pin_memory=self.pin_memory)
        return torch.cat([item.tensors[IDS_KEY] for item in items], out=out)
