"""Rebuild jobs/data/demo-images.parquet from the team's shared media (../shared/data).

The demo dataset is real photos (MIT/Apache-licensed test assets, see
jobs/data/LICENSES.tsv) plus two rows that must become error rows: a JPEG cut in half
and a text file. Run from the repository root: python scripts/make_demo_data.py
"""

from __future__ import annotations

import csv
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHARED = Path("../shared/data")
IMAGES = [
    "img2dataset_123_456.jpg",
    "img2dataset_208_495.jpg",
    "img2dataset_321_421.jpg",
    "img2dataset_389_535.jpg",
    "img2dataset_416_264.jpg",
    "img2dataset_456_123.jpg",
    "img2dataset_524_316.jpg",
    "hfdatasets_test_image_rgb.jpg",
    "hfdatasets_test_image_rgba.png",
    "mmaction2_test.jpg",
]
OUT = Path("jobs/data")


def main() -> None:
    manifest = {row["file"]: row for row in csv.DictReader(open(SHARED / "MANIFEST.tsv"), delimiter="\t")}
    ids, blobs, licences = [], [], []
    for name in IMAGES:
        ids.append(name.rsplit(".", 1)[0])
        blobs.append((SHARED / "images" / name).read_bytes())
        licences.append(manifest[f"images/{name}"])
    whole = (SHARED / "images" / "img2dataset_321_421.jpg").read_bytes()
    ids.append("truncated_jpeg")
    blobs.append(whole[: len(whole) // 2])
    ids.append("text_not_an_image")
    blobs.append(b"this row holds text, not an image\n")
    table = pa.table({"id": pa.array(ids), "image": pa.array(blobs, type=pa.binary())})
    OUT.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, OUT / "demo-images.parquet", row_group_size=6)
    ours = [[name.rsplit(".", 1)[0], row["source"], row["original_path"], row["license_or_note"]] for name, row in zip(IMAGES, licences)]
    ours.append(["truncated_jpeg", "derived here", "first half of img2dataset_321_421.jpg", "as its source (MIT repo)"])
    ours.append(["text_not_an_image", "written here", "-", "public domain"])
    write_licences(OUT / "LICENSES.tsv", ours)


def write_licences(path: Path, ours: list[list[str]]) -> None:
    """Replace this script's rows in the shared licence file, keeping the other demos' rows."""
    header = ["id", "source", "original_path", "license_or_note"]
    mine = {row[0] for row in ours}
    others = []
    if path.exists():
        with open(path, newline="") as handle:
            others = [row for row in list(csv.reader(handle, delimiter="\t"))[1:] if row and row[0] not in mine]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t")
        writer.writerows([header, *ours, *others])


if __name__ == "__main__":
    main()
