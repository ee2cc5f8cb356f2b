"""Any-resolution tiling for fixed-resolution encoders: a grid of local tiles per image.

A fixed-resolution encoder sees a whole image only at its input size (e.g. 224 x 224),
which loses the detail of a large photo. The dual-path mode adds local tiles: the image
is resized into a grid of `rows x cols` tiles of the encoder's input size, and each tile
is encoded like an image of its own.

The grid is chosen like LLaVA-NeXT's "anyres": among grids with rows * cols <= max_tiles,
take the one whose canvas keeps the most of the image's pixels after an aspect-preserving
fit (never counting more than the image has), then the one that wastes the least canvas.
A best grid of 1 x 1 means the image is no larger than one tile in any useful way: it gets
no tiles (its global view already holds all its detail), which the packer sees as 0 local
tokens.

Invariants: `select_grid` returns rows, cols >= 1 with rows * cols <= max_tiles and is a
pure function of its integer arguments; `cut_tiles` returns rows * cols tiles of exactly
the tile size, in row-major order, with the resized image centred on a black canvas.
"""

from __future__ import annotations

import torch
import torchvision.transforms.v2.functional as tvF


def select_grid(height: int, width: int, tile_height: int, tile_width: int, max_tiles: int) -> tuple[int, int]:
    """The (rows, cols) grid that keeps the most image detail for at most `max_tiles` tiles.

    Ties on kept pixels go to the smaller canvas (less padding computed for nothing),
    then to the grid enumerated first (fewer rows), so the choice is deterministic.
    """
    if min(height, width, tile_height, tile_width, max_tiles) < 1:
        raise ValueError(
            f"select_grid needs positive sizes, got image {height}x{width}, tile {tile_height}x{tile_width}, "
            f"max_tiles={max_tiles}"
        )
    best, best_key = (1, 1), None
    for rows in range(1, max_tiles + 1):
        for cols in range(1, max_tiles // rows + 1):
            canvas_h, canvas_w = rows * tile_height, cols * tile_width
            scale = min(canvas_h / height, canvas_w / width)
            kept = min(int(height * scale) * int(width * scale), height * width)
            key = (kept, -(canvas_h * canvas_w))
            if best_key is None or key > best_key:
                best, best_key = (rows, cols), key
    return best


def fit_size(height: int, width: int, canvas_height: int, canvas_width: int) -> tuple[int, int]:
    """The aspect-preserving size of the image inside the canvas (each side >= 1, <= the canvas)."""
    scale = min(canvas_height / height, canvas_width / width)
    return (
        min(canvas_height, max(1, round(height * scale))),
        min(canvas_width, max(1, round(width * scale))),
    )


def cut_tiles(
    image: torch.Tensor, grid: tuple[int, int], tile_size: tuple[int, int], interpolation: tvF.InterpolationMode
) -> torch.Tensor:
    """(3, H, W) uint8 -> (rows * cols, 3, tile_h, tile_w) uint8 tiles, row-major.

    The image is resized (antialiased, like the encoders' processors) to fit the grid's
    canvas and centred on black, so no tile holds a stretched image; the black margins
    are what LLaVA-NeXT pads with too.
    """
    rows, cols = grid
    tile_h, tile_w = tile_size
    canvas_h, canvas_w = rows * tile_h, cols * tile_w
    new_h, new_w = fit_size(image.shape[-2], image.shape[-1], canvas_h, canvas_w)
    resized = tvF.resize(image[None], [new_h, new_w], interpolation=interpolation, antialias=True)[0]
    canvas = torch.zeros((image.shape[0], canvas_h, canvas_w), dtype=image.dtype)
    top, left = (canvas_h - new_h) // 2, (canvas_w - new_w) // 2
    canvas[:, top : top + new_h, left : left + new_w] = resized
    tiles = canvas.view(image.shape[0], rows, tile_h, cols, tile_w).permute(1, 3, 0, 2, 4)
    return tiles.reshape(rows * cols, image.shape[0], tile_h, tile_w)
