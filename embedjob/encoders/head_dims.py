"""How the segment kernel splits a head dim: plain arithmetic on ints, shared by the
kernel (`encoders.attention_kernel`) and the layer that picks it (`encoders.attention`),
so neither imports the other for it. It imports nothing: `attention.cuda_kernel` asks it
inside compiled blocks, where only plain arithmetic on ints traces without a Triton
import or a cached call."""


def head_split(dim: int) -> tuple[int, int] | None:
    """(main, tail): main the largest power of two <= dim, tail the rest, which must be 0
    or a power of two of at least 16; None for other dims, which the caller runs in
    another kernel. Why no masked columns: head dim 72 as 64 + 16 with 8 columns masked
    was exact in Triton's interpreter but, compiled by Triton 3.6 on an H200, gave wrong
    tail columns and illegal memory accesses (tests/test_attention.py keeps 72 off this kernel)."""
    main = 1 << (dim.bit_length() - 1)
    rest = dim - main
    if rest and (rest < 16 or rest & (rest - 1)):
        return None
    return main, rest
