"""Build jobs/data/demo-videos.parquet, the dataset of the video demo (jobs/demo-video.yaml).

Rows are small clips and one photo from tests/data (Apache-2.0, MIT and BSD-3-Clause
test assets; their licence lines are appended to jobs/data/LICENSES.tsv), chosen to show
what a video job meets: a rotated phone clip, out-of-order (B-frame) frames, a tiny
odd-sized 60 fps clip, HEVC, 10-bit H.264, a JPEG among the videos (`modality: auto`
decides per row from the bytes), and three rows that must become error rows: AV1 (which
decord's FFmpeg 4.1 cannot decode), a clip with corrupt H.264 units, and a MOV cut
before its index, derived here.

The file is shared with other demos (e.g. a SigLIP video demo), so an existing one is
kept unless --force is given. Run from the repository root:

    python scripts/make_demo_videos.py [--force]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SOURCE = Path("tests/data")
OUT = Path("jobs/data")
PARQUET = OUT / "demo-videos.parquet"
LICENSES = OUT / "LICENSES.tsv"

# (row id, file in tests/data), in row order.
COPIED = [
    ("decord_video_90", "decord_video_90.mov"),
    ("decord_unordered", "decord_unordered.mov"),
    ("hfdatasets_test_video_66x50", "hfdatasets_test_video_66x50.mov"),
    ("img2dataset_123_456", "img2dataset_123_456.jpg"),
    ("torchcodec_h265_video", "torchcodec_h265_video.mp4"),
    ("torchcodec_h264_10bits", "torchcodec_h264_10bits.mp4"),
    ("torchcodec_av1_video", "torchcodec_av1_video.mkv"),
    ("decord_corrupted", "decord_corrupted.mp4"),
]
TRUNCATED_ID = "truncated_mov"
TRUNCATED_SOURCE = "hfdatasets_test_video_66x50.mov"
# The clip's moov (its frame index) lies after the first 20000 bytes: cut there, the
# container cannot be indexed and the row is a `truncated` error.
TRUNCATED_BYTES = 20_000
ROWS_PER_GROUP = 3


def build_rows() -> tuple[list[str], list[bytes]]:
    ids = [row_id for row_id, _ in COPIED]
    blobs = [(SOURCE / name).read_bytes() for _, name in COPIED]
    ids.append(TRUNCATED_ID)
    blobs.append((SOURCE / TRUNCATED_SOURCE).read_bytes()[:TRUNCATED_BYTES])
    return ids, blobs


def licence_lines() -> list[list[str]]:
    """One LICENSES.tsv line per row, from tests/data/LICENSES.tsv (same provenance)."""
    with open(SOURCE / "LICENSES.tsv", newline="") as handle:
        known = {row["file"]: row for row in csv.DictReader(handle, delimiter="\t")}
    lines = []
    for row_id, name in COPIED:
        entry = known[name]
        lines.append([row_id, entry["source"], entry["original_path"], entry["license_or_note"]])
    lines.append(
        [TRUNCATED_ID, "derived here", f"first {TRUNCATED_BYTES} bytes of {TRUNCATED_SOURCE}", "as its source (Apache-2.0 repo)"]
    )
    return lines


def append_licences(lines: list[list[str]]) -> None:
    """Append the lines whose id is not listed yet; other datasets' lines stay as they are."""
    with open(LICENSES, newline="") as handle:
        listed = {row[0] for row in csv.reader(handle, delimiter="\t") if row}
    missing = [line for line in lines if line[0] not in listed]
    with open(LICENSES, "a", newline="") as handle:
        csv.writer(handle, delimiter="\t").writerows(missing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild the Parquet even if it exists")
    args = parser.parse_args()
    if PARQUET.exists() and not args.force:
        sys.exit(f"{PARQUET} exists (other demos may use it); keeping it. Pass --force to rebuild it.")
    ids, blobs = build_rows()
    table = pa.table({"id": pa.array(ids), "media": pa.array(blobs, type=pa.binary())})
    OUT.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, PARQUET, row_group_size=ROWS_PER_GROUP)
    append_licences(licence_lines())
    print(f"wrote {PARQUET}: {len(ids)} rows, {PARQUET.stat().st_size} bytes")


if __name__ == "__main__":
    main()
