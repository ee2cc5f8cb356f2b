"""Format detection from magic numbers: which decoder an item's bytes go to.

File names and declared MIME types are never used: datasets mislabel them (an MP4 named
.jpg is a video). See ARCHITECTURE.md, "decode".
"""

from __future__ import annotations

# ISO-BMFF major brands of still images (Pillow's format names): the rest is video.
_IMAGE_BRANDS = {
    b"avif": "AVIF", b"avis": "AVIF",
    b"heic": "HEIF", b"heix": "HEIF", b"heim": "HEIF", b"heis": "HEIF", b"mif1": "HEIF", b"msf1": "HEIF",
}
_QUICKTIME_FIRST_BOXES = {b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"}


def sniff_format(data: bytes) -> tuple[str, str] | None:
    """(modality, format name) from magic numbers, or None. File names are never used:
    datasets mislabel them."""
    head = data[:16]
    if head.startswith(b"\xff\xd8\xff"):
        return "image", "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image", "PNG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image", "GIF"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "image", "TIFF"
    if head[:2] == b"BM" and len(data) >= 26 and data[6:10] == b"\x00\x00\x00\x00":
        return "image", "BMP"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image", "WEBP"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "video", "AVI"
    if head[:4] == b"\x00\x00\x01\x00" and len(data) >= 22 and data[4:6] != b"\x00\x00":
        return "image", "ICO"
    if head.startswith(b"\x00\x00\x00\x0cjP  \r\n\x87\n") or head[:4] == b"\xff\x4f\xff\x51":
        return "image", "JPEG2000"
    if head[4:8] == b"ftyp":
        if head[8:12] in _IMAGE_BRANDS:
            return "image", _IMAGE_BRANDS[head[8:12]]
        return "video", "MP4"
    if head[4:8] in _QUICKTIME_FIRST_BOXES:
        return "video", "MOV"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "video", "MATROSKA"
    if head[:3] == b"FLV":
        return "video", "FLV"
    if head[:4] == b"OggS":
        return "video", "OGG"
    if head[:4] == b"\x00\x00\x01\xba":
        return "video", "MPEG-PS"
    if head[:8] == b"\x30\x26\xb2\x75\x8e\x66\xcf\x11":
        return "video", "ASF"
    if len(data) > 376 and data[0] == data[188] == data[376] == 0x47:  # three 188-byte packets
        return "video", "MPEG-TS"
    return None
