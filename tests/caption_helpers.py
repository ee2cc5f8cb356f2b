"""Tiny full checkpoints (vision and text) with their tokenizers, and caption jobs over
real photos, for tests/test_captions.py and tests/test_gpu.py's caption tests.

A transformers checkpoint (CLIP, MetaCLIP 2, SigLIP, SigLIP 2) is built from a config
(random weights, fixed seed) with a small BPE tokenizer trained through `tokenizers` on
SENTENCES, wrapped as transformers wraps one, and saved with `save_pretrained` beside its
image processor: what a user's checkpoint is. An OpenCLIP one is saved in its hub layout
(`open_clip_config.json` and safetensors): `open_clip` takes OpenCLIP's default tokenizer
(CLIP's BPE, shipped in the package), `open_clip_hf` a SigLIP-like custom text tower
whose config names a Hugging Face tokenizer, trained here and saved beside the weights.
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
SIGLIP2_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, patch_size=8, num_patches=64)
OPEN_CLIP_VISION = {"image_size": 64, "patch_size": 16, "width": 64, "head_width": 16, "layers": 2, "mlp_ratio": 2.0}
OPEN_CLIP_PREPROCESS = {"mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bicubic", "resize_mode": "shortest"}
FAMILY_OF = {"open_clip_hf": "open_clip"}
"""The job's model.family of a checkpoint kind that is not itself one."""


def train_tokenizer(family: str) -> transformers.PreTrainedTokenizerFast:
    """A small BPE tokenizer trained on SENTENCES, wrapped as transformers wraps one:
    CLIP's frames a caption with BOS and EOS, SigLIP's ends it with EOS."""
    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=120, special_tokens=specials))
    last = family in ("siglip", "siglip2", "open_clip_hf")  # pooled at the last position
    template = "$A <eos>" if last else "<bos> $A <eos>"
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<bos>", 2), ("<eos>", 3)])
    pad = "<eos>" if last else "<pad>"  # SigLIP's tokenizers pad with their EOS
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token=pad, unk_token="<unk>", model_max_length=LENGTH
    )


def save_checkpoint(family: str, directory: Path, tokenizer: bool = True) -> Path:
    """A tiny full CLIP, MetaCLIP 2, SigLIP, SigLIP 2 or OpenCLIP model (`family` a
    family or `open_clip_hf`) with its image processor and (unless told not to) its
    tokenizer, saved as a user's checkpoint is."""
    if family.startswith("open_clip"):
        return save_open_clip(family, directory, tokenizer)
    tok = train_tokenizer(family)
    ids = dict(vocab_size=len(tok), max_position_embeddings=LENGTH, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    # SigLIP's text head projects to its own width, which is the vision tower's in every published checkpoint.
    text = dict(hidden_size=64 if family in ("siglip", "siglip2") else 32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **ids)
    torch.manual_seed(0)
    if family == "clip":
        config = transformers.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=24)
        model = transformers.CLIPModel._from_config(config, dtype=torch.float32)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    elif family == "metaclip2":
        config = transformers.MetaClip2Config(text_config=text, vision_config=VISION, projection_dim=24)
        model = transformers.MetaClip2Model._from_config(config, dtype=torch.float32)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    elif family == "siglip2":
        config = transformers.Siglip2Config(text_config=text, vision_config=SIGLIP2_VISION)
        model = transformers.Siglip2Model._from_config(config, dtype=torch.float32)
        processor = transformers.Siglip2ImageProcessor(patch_size=8, max_num_patches=96)
    else:
        config = transformers.SiglipConfig(text_config=text, vision_config=VISION)
        model = transformers.SiglipModel._from_config(config, dtype=torch.float32)
        processor = transformers.SiglipImageProcessor(size={"height": 64, "width": 64})
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    if tokenizer:
        tok.save_pretrained(directory)
    return directory


def save_open_clip(kind: str, directory: Path, tokenizer: bool = True) -> Path:
    """A tiny OpenCLIP model in its hub layout. `open_clip`: a `CLIP` whose text tower
    takes OpenCLIP's default tokenizer (its vocabulary; a context of LENGTH tokens,
    argmax pooling, causal). `open_clip_hf`: a `CustomTextCLIP` laid out as OpenCLIP's
    SigLIP (bidirectional, pooled at the last position, a biased linear projection) whose
    text_cfg names a Hugging Face tokenizer, saved beside the weights unless told not to."""
    import open_clip

    from embedjob.encoders.open_clip import save_checkpoint as save_open_clip_checkpoint

    directory.mkdir(parents=True, exist_ok=True)
    if kind == "open_clip":
        text_cfg = {"context_length": LENGTH, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}
        model_cfg = {"embed_dim": 24, "vision_cfg": OPEN_CLIP_VISION, "text_cfg": text_cfg}
        cls = open_clip.CLIP
    else:
        tok = train_tokenizer(kind)
        text_cfg = {
            "context_length": LENGTH, "vocab_size": len(tok), "hf_tokenizer_name": "example/tiny-siglip", "width": 64,
            "heads": 2, "layers": 2, "no_causal_mask": True, "proj_bias": True, "pool_type": "last",
        }
        model_cfg = {"embed_dim": 64, "custom_text": True, "init_logit_bias": -10, "vision_cfg": OPEN_CLIP_VISION, "text_cfg": text_cfg}
        cls = open_clip.CustomTextCLIP
        if tokenizer:
            tok.save_pretrained(directory)
    torch.manual_seed(0)
    model = cls(**{k: v for k, v in model_cfg.items() if k != "custom_text"})
    save_open_clip_checkpoint(model, model_cfg, OPEN_CLIP_PREPROCESS, directory)
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
