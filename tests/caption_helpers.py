"""Tiny CLIP and SigLIP full checkpoints with tokenizers trained here, and caption jobs
over real photos, for tests/test_captions.py and tests/test_gpu.py's caption tests.

A checkpoint is built from a config (random weights, fixed seed) with a small BPE
tokenizer trained through `tokenizers` on SENTENCES, wrapped as transformers wraps one,
and saved with `save_pretrained` beside its image processor: what a user's checkpoint is.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parent.parent
PHOTOS = ["img2dataset_123_456.jpg", "img2dataset_456_123.jpg", "hfdatasets_test_image_rgba.png"]
SENTENCES = [
    "a photo of a cat", "a dog on the grass", "two birds in the sky", "a red car parked in the street",
    "a cat sleeping on a sofa", "the sky over the sea at night", "a bird on a branch",
]
LENGTH = 16
LABELS = ["a photo of a cat", "a dog on the grass", "a red car parked"]
LONG = " ".join(SENTENCES)  # far beyond LENGTH tokens: truncated as the tokenizer truncates
# (photo index or None for broken bytes, caption): a null caption, an image that does
# not decode with a caption, a caption past the model's length, an empty caption.
ROWS = [(0, "a photo of a cat"), (1, None), (None, "a dog on the grass"), (2, LONG), (0, "two birds in the sky"), (1, "")]
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16)


def train_tokenizer(family: str) -> transformers.PreTrainedTokenizerFast:
    """A small BPE tokenizer trained on SENTENCES, wrapped as transformers wraps one:
    CLIP's frames a caption with BOS and EOS, SigLIP's ends it with EOS."""
    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=120, special_tokens=specials))
    template = "$A <eos>" if family == "siglip" else "<bos> $A <eos>"
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<bos>", 2), ("<eos>", 3)])
    pad = "<eos>" if family == "siglip" else "<pad>"  # SigLIP's tokenizers pad with their EOS
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token=pad, unk_token="<unk>", model_max_length=LENGTH
    )


def save_checkpoint(family: str, directory: Path, tokenizer: bool = True) -> Path:
    """A tiny full CLIP, MetaCLIP 2 or SigLIP model with its image processor and (unless told not
    to) its tokenizer, saved as a user's checkpoint is."""
    tok = train_tokenizer(family)
    ids = dict(vocab_size=len(tok), max_position_embeddings=LENGTH, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    # SigLIP's text head projects to its own width, which is the vision tower's in every published checkpoint.
    text = dict(hidden_size=64 if family == "siglip" else 32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **ids)
    torch.manual_seed(0)
    if family == "clip":
        config = transformers.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=24)
        model = transformers.CLIPModel._from_config(config, dtype=torch.float32)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    elif family == "metaclip2":
        config = transformers.MetaClip2Config(text_config=text, vision_config=VISION, projection_dim=24)
        model = transformers.MetaClip2Model._from_config(config, dtype=torch.float32)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    else:
        config = transformers.SiglipConfig(text_config=text, vision_config=VISION)
        model = transformers.SiglipModel._from_config(config, dtype=torch.float32)
        processor = transformers.SiglipImageProcessor(size={"height": 64, "width": 64})
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    if tokenizer:
        tok.save_pretrained(directory)
    return directory


def write_input(path: Path) -> Path:
    photos = [(REPO / "tests" / "data" / name).read_bytes() for name in PHOTOS]
    table = pa.table({
        "key": [f"r{k}" for k in range(len(ROWS))],
        "image": [photos[p] if p is not None else b"not an image at all" for p, _ in ROWS],
        "caption": pa.array([c for _, c in ROWS], type=pa.string()),
    })
    pq.write_table(table, path)
    return path


def job(tmp_path: Path, cache_dir: str, family: str, model: Path, **sections: dict) -> dict:
    raw = {
        "input": {"path": str(write_input(tmp_path / "in.parquet")), "media_column": "image", "id_column": "key", "text_column": "caption"},
        "model": {"family": family, "path": str(model)},
        "output": {"path": str(tmp_path / "out"), "dtype": "float32", "labels": LABELS},
        "runtime": {"device": "cpu", "workers": 0, "progress": False, "cache_dir": cache_dir},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def read(out: Path) -> pa.Table:
    return pq.read_table(sorted(out.glob("part-*.parquet")))
