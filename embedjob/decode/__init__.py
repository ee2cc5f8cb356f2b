"""Bytes to pixels: media sniffing, image and video decoding (see ARCHITECTURE.md)."""
