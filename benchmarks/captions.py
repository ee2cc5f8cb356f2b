"""Images and captions against images alone, end to end on one GPU (RESULTS.md section 14).

On the GPU machine, from the repository root (`bench-data`: photos, optional as in scaling.py):

    PYTHONPATH=. python3 benchmarks/captions.py --photos bench-data --models clip
    PYTHONPATH=. python3 benchmarks/captions.py --photos bench-data --models siglip

Builds full checkpoints (vision and text) of the published sizes with random bf16 weights
(seed 0): CLIP-L/14-336 (the scaling mix's vision tower, `mixes.TOWERS`, and CLIP-L's text
tower: 12 layers of 768, 77 tokens, vocabulary 49,408) and SigLIP-so400m-384 (its vision
tower and its text tower: 27 layers of 1,152, 64 tokens, vocabulary 32,000), each saved
with `save_pretrained` beside its image processor config and a BPE tokenizer trained here
on the captions. The rows are the scaling mixes' distinct JPEGs (256-1,024 px, cut from
real photos, `mixes.jpeg_dataset`) with a caption each: 5-40 words drawn from a fixed
list (seeded), so CLIP truncates the longest and every caption costs the model's length.

Each model runs `python -m embedjob.cli run` (bf16, `batching.compile: true`, CUDA
graphs, decoding included) `--repeats` times in each of two ways, alternating: images
alone, and images with `input.text_column: caption` (text_embedding and score per row).
Columns: images/s is the rows encoded after setup over `pipeline_seconds` (median of the
repeats); "vs images alone" the captions run's rate over the images-alone run's (the
issue's target: at least 0.9); "device s" rank 0's measured device seconds (images and
captions); setup s the best repeat's; "text graphs" the caption batches' graph hit rate.
`--smoke` runs everything on the CPU with tiny towers of the same architectures, 24 images
and one repeat, so the script can be checked on a machine without a GPU. Logs and the
table go to `--workdir` (towers and JPEGs are built once there and reused).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import builtin_sources, collect_photos, fmt, rank0, run_cli, table, timed_rows  # noqa: E402
from benchmarks.common import log as _log  # noqa: E402
from benchmarks.mixes import MIXES, SMOKE_IMAGES, TOWERS, Tower, jpeg_dataset  # noqa: E402

TEXT_TOWERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "clip": (
        dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=49408, max_position_embeddings=77),
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=4096, max_position_embeddings=77),
    ),
    "siglip": (
        dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, vocab_size=32000, max_position_embeddings=64),
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=4096, max_position_embeddings=64),
    ),
}
"""Each family's text tower (published size, tiny for --smoke); SigLIP's width is its vision tower's."""
WORDS = (
    "a the of on in with and at near under over two three small large red blue green white black old young "
    "cat dog bird car bus tree house street river mountain beach city field table chair window person child "
    "woman man group people sitting standing running walking holding looking playing parked flying sleeping "
    "photo picture view close up night day morning sunset snow rain sky water road garden kitchen room"
).split()
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]


def log(message: str) -> None:
    _log("captions", message)


def captions(count: int, seed: int) -> list[str]:
    """`count` captions of 5-40 words from WORDS, the same for a seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(count)]


def save_full_model(family: str, tower: Tower, texts: list[str], directory: Path, smoke: bool) -> Path:
    """A full checkpoint (vision, text, image processor, tokenizer) built once under `directory`."""
    from embedjob.encoders.loading import save_atomically

    target = directory / (f"{tower.key}-full-tiny" if smoke else f"{tower.key}-full")
    save_atomically(lambda tmp: _build(family, tower, texts, tmp, smoke), target)
    return target


def _build(family: str, tower: Tower, texts: list[str], directory: Path, smoke: bool) -> None:
    import transformers

    vision = tower.tiny if smoke else tower.full
    text = dict(TEXT_TOWERS[family][1 if smoke else 0], pad_token_id=0, bos_token_id=2, eos_token_id=3)
    side = vision["image_size"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with device:
        if family == "clip":
            config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=vision["projection_dim"])
            model = transformers.CLIPModel._from_config(config, dtype=torch.bfloat16)
            processor = transformers.CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        else:
            config = transformers.SiglipConfig(text_config=text, vision_config=vision)
            model = transformers.SiglipModel._from_config(config, dtype=torch.bfloat16)
            processor = transformers.SiglipImageProcessor(size={"height": side, "width": side})
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    tokenizer(family, texts, text["max_position_embeddings"]).save_pretrained(directory)


def tokenizer(family: str, texts: list[str], length: int) -> Any:
    """A BPE tokenizer trained on `texts`, framed as the family's: CLIP's with BOS and EOS
    (padded with its pad token), SigLIP's ending with EOS (padded with it)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIALS))
    template = "<bos> $A <eos>" if family == "clip" else "$A <eos>"
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<bos>", 2), ("<eos>", 3)])
    pad = "<pad>" if family == "clip" else "<eos>"
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token=pad, unk_token="<unk>", model_max_length=length
    )


def captioned(images: Path, texts: list[str], target: Path) -> Path:
    """The mix's Parquet file with a `caption` column beside its images (made once)."""
    if not target.exists():
        data = pq.read_table(images)
        pq.write_table(data.append_column("caption", pa.array(texts[: data.num_rows], type=pa.string())), target, row_group_size=128)
    return target


def write_job(path: Path, model: Path, data: Path, family: str, text: bool, cache: Path, smoke: bool) -> Path:
    job = {
        "input": {"path": str(data), "media_column": "image", **({"text_column": "caption"} if text else {})},
        "model": {"family": family, "path": str(model), "dtype": "bfloat16"},
        "output": {"path": str(path.parent / "out"), "rows_per_part": 100_000},
        "batching": {"compile": not smoke},
        "runtime": {"device": "cpu" if smoke else "cuda", "progress": False, "cache_dir": str(cache)},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def bench_model(family: str, args: argparse.Namespace, workdir: Path, photos: list) -> list[list[str]]:
    """Both ways of one model, `args.repeats` times each, alternating; its table rows."""
    mix = MIXES[family]
    count = SMOKE_IMAGES if args.smoke else args.images
    texts = captions(count, args.seed)
    images = jpeg_dataset(mix, count, args.seed, photos, workdir / "data", len(os.sched_getaffinity(0)))
    data = captioned(images.path, texts, workdir / "data" / f"{images.path.stem}-captions.parquet")
    model = save_full_model(family, TOWERS[family], texts, workdir / "towers", args.smoke)
    runs: dict[str, list[dict[str, Any]]] = {"images alone": [], "images + captions": []}
    for repeat in range(args.repeats):
        for way, text in (("images alone", False), ("images + captions", True)):
            run_dir = workdir / family / ("captions" if text else "images")
            job = write_job(run_dir / "job.yaml", model, data, family, text, workdir / "cache", args.smoke)
            stats = run_cli(job, run_dir / "out", 1, [], run_dir / f"run-{repeat}.log")
            if stats is None:
                raise SystemExit(f"{family} {way} failed: see {run_dir / f'run-{repeat}.log'}")
            log(f"[{family}] {way}, repeat {repeat + 1}/{args.repeats}: pipeline {stats['pipeline_seconds']:.2f} s")
            runs[way].append(stats)
    base = rate(runs["images alone"])
    rows = []
    for way, stats in runs.items():
        ours = rate(stats)
        text = [s.get("text") for s in stats]
        rows.append([
            mix.tower.describe(args.smoke), way, str(stats[0]["rows"]),
            fmt(statistics.median(s["pipeline_seconds"] for s in stats), ".2f"), fmt(ours, ".1f"),
            fmt(ours / base if ours and base else None, ".3f"),
            fmt(statistics.median(rank0(s).get("busy_seconds", float("nan")) for s in stats), ".2f"),
            fmt(min(s["setup_seconds"] for s in stats), ".1f"),
            fmt(text[0]["hit_rate"], ".0%") if text[0] else "-",
        ])
    return rows


def rate(runs: list[dict[str, Any]]) -> float | None:
    rates = [timed_rows(s) / s["pipeline_seconds"] for s in runs if s["pipeline_seconds"]]
    return statistics.median(rates) if rates else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["clip", "siglip"], choices=["clip", "siglip"])
    parser.add_argument("--images", type=int, default=8192, help="rows per model (default 8192; 24 with --smoke)")
    parser.add_argument("--repeats", type=int, help="CLI runs per way, the median reported (default 2; 1 with --smoke)")
    parser.add_argument("--workdir", default="captions-work")
    parser.add_argument("--photos", nargs="+", action="extend", type=Path, default=[], help="directories or files of photos")
    parser.add_argument("--seed", type=int, default=0, help="seed of the JPEGs and the captions")
    parser.add_argument("--smoke", action="store_true", help="CPU only: tiny towers, 24 images, one repeat, no compile")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 2
    if args.repeats < 1 or args.images < 1:
        parser.error("--repeats and --images take positive numbers")
    return args


def main() -> int:
    args = parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU is visible; run with --smoke to exercise the script on the CPU")
    started = time.perf_counter()
    workdir = Path(args.workdir).resolve()
    photos = collect_photos([*builtin_sources(), *args.photos])
    rows = [row for family in args.models for row in bench_model(family, args, workdir, photos)]
    head = ["model", "run", "rows", "seconds", "images/s", "vs images alone", "device s", "setup s", "text graphs"]
    device = "CPU (--smoke)" if args.smoke else torch.cuda.get_device_name()
    lines = [
        f"device: {device}; {args.repeats} repeat(s) per way, median; wall {time.perf_counter() - started:.0f} s",
        f"command: python3 benchmarks/captions.py {' '.join(sys.argv[1:])}",
        "",
        *table(head, rows, text_columns=2),
    ]
    text = "\n".join(lines)
    (workdir / "captions.md").write_text(text + "\n")
    (workdir / "captions.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
