"""`preprocess.decoder: auto` and `video.decoder: auto`: how many of a rank's rows leave
their media (a JPEG, a video's sampled frames) for the GPU's decoder.

A rank's pipeline (pipeline.py) measures three rates as it runs (what its decode
workers decode, what its device encodes, what its GPU-decode thread decodes) and, after
every window, sets the share of the rows it submits whose media the GPU decodes
(`gpu_share`); the decode pool picks those rows evenly (`DecodeSplit`), a video's when a
worker starts it, so that what the workers start while the rank sets up is theirs.
One split serves one kind of media: a video job splits its videos, any other its JPEGs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from embedjob.rows import Decoded, left_for_device

FIRST_SHARE = {"jpeg": 0.0, "video": 0.5}
"""The GPU's share of the rows from when the rank is ready (`DecodeSplit.ready`: its graphs
captured) until auto first measures its rates (after `pipeline.AUTO_ROWS` items: by then
the pool has taken the two windows it keeps in flight). JPEGs start on the workers, whose
pixels are the processors' own. Videos start split evenly: two windows are 512 clips, tens
of seconds of decoding (on an H100, 16 decord workers read 16.9 clips/s, NVDEC in 4
sessions 11.7), and a job of 216 clips that started on the workers alone gave NVDEC none."""

SETUP_SHARE = 0.0
"""The GPU's share of the videos a worker starts while the rank sets up: none, as its GPU
decodes nothing before its graphs are captured, while the workers decode from the start.
A video job decides when a worker starts a row (`DecodePool`'s `assign`), so the workers'
head start is theirs: at `FIRST_SHARE` from the first row, `auto` left half of 128 clips to
NVDEC and ran 0.447 of SigLIP-so400m's encoder alone where decord alone, its workers
decoding through the 12 s setup, ran 0.909 (an H100, benchmarks/RESULTS.md section 11)."""

AUTO_MARGIN = 1.2
"""How much faster than the device the workers must decode the rows auto leaves them."""


def gpu_share(worker_rate: float, device_rate: float, gpu_rate: float, margin: float = AUTO_MARGIN) -> float:
    """The share of rows whose media auto leaves for the GPU, in
    [0, 1], from rows per second: what the decode workers decode, what the device
    encodes, what the GPU-decode thread decodes (inf while unmeasured).

    The workers keep all they decode `margin` times faster than the device encodes, and
    the GPU gets the rest (1 - worker_rate / (margin * device_rate)): the CPU path costs
    the device nothing and gives the processors' own pixels. Where the two decoders
    together cannot keep up with the device, the share that has each finish its part at
    the same time (gpu_rate / (worker_rate + gpu_rate)) is the larger throughput."""
    wanted = 1.0 - worker_rate / (margin * device_rate)
    balanced = 1.0 if math.isinf(gpu_rate) else gpu_rate / (worker_rate + gpu_rate)
    return min(max(min(wanted, balanced), 0.0), 1.0)


@dataclass
class DecodeSplit:
    """Which submitted rows leave their media for the GPU (the decoder set to auto).

    `share` of them, spread evenly: a row is left when the running sum of `share` passes
    a whole number, so a share of 0.25 leaves every fourth row. `leave` runs on one of
    the decode pool's threads: for a video as a worker is sent its row, for a JPEG as
    the pool takes it (the pool reads a JPEG left for the GPU itself, before any worker);
    the main thread changes `share` between windows and `count`s the rows the workers
    decoded and their seconds (what they decode per second)."""

    share: float = 0.0
    credit: float = 0.0
    worker_rows: int = 0
    worker_seconds: float = 0.0
    media: str | None = None

    @classmethod
    def first(cls, media: str | None) -> DecodeSplit:
        """The split a rank starts with for `media` ("jpeg", "video"; None where nothing is
        split), until it is `ready`: `SETUP_SHARE` of the videos, `FIRST_SHARE` of the JPEGs."""
        split = cls(media=media)
        split._start(SETUP_SHARE if media == "video" else FIRST_SHARE.get(media, 0.0))
        return split

    def ready(self) -> None:
        """The rank can decode on its GPU from now on: `FIRST_SHARE` of the rows until auto
        has measured."""
        self._start(FIRST_SHARE.get(self.media, 0.0))

    def _start(self, share: float) -> None:
        """`share` from the next row on, that row left for the GPU where the share is above
        0, so its decoder's rate is measured from the first window it decodes. Started at
        the second row, a share of 0.5 left the demo job's 9 clips' four the GPU's decoder
        refuses (50 x 50, 10-bit, corrupt, not a video) and it decoded none."""
        self.share, self.credit = share, 1.0 - share if share > 0 else 0.0

    def leave(self) -> bool:
        self.credit += self.share
        if self.credit >= 1.0:
            self.credit -= 1.0
            return True
        return False

    def count(self, window: list[Decoded]) -> None:
        for decoded in window:
            if not left_for_device(decoded):
                self.worker_rows += 1
                self.worker_seconds += decoded.seconds
