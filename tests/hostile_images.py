"""Hostile and worst-case image files, made on the spot (nothing hostile is stored in the repository).

Each maker returns the file's bytes. ``LEGIT`` are the costliest files the limits must still accept (the
largest allowed image in each format and pixel mode); ``HOSTILE`` are files whose decode costs far more
than their header or size say. The fault suite sends them to real servers; ``bench/decode_limits.py``
measures what each costs to decode and how the decode processes answer.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pillow_heif
from PIL import Image

SIDE = 7000  # 49 MP: under the default limit of 50 MP


def encode(image: Image.Image, image_format: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels: what compresses worst and decodes slowest."""
    bands = len(Image.new(mode, (1, 1)).getbands())
    shape = (height, width, bands) if bands > 1 else (height, width)
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8), mode)


# --- JPEG -----------------------------------------------------------------------------------------------


def _segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each JPEG segment; a scan (SOS) runs to the next marker that is not RSTn."""
    found, position = [], 2
    while position < len(data):
        marker = data[position + 1]
        if marker == 0xD9:  # EOI
            found.append((marker, position, position + 2))
            break
        length = struct.unpack(">H", data[position + 2 : position + 4])[0]
        end = position + 2 + length
        if marker == 0xDA:  # entropy-coded data follows: up to the next marker
            while not (data[end] == 0xFF and data[end + 1] not in (0x00, *range(0xD0, 0xD8))):
                end += 1
        found.append((marker, position, end))
        position = end
    return found


def jpeg_repeated_scan(repeats: int, side: int = SIDE) -> bytes:
    """A progressive JPEG whose last (small) scan is repeated ``repeats`` times: libjpeg runs over every
    coefficient of the image for each scan, so a few hundred KB decode for minutes."""
    data = encode(Image.new("L", (side, side)), "JPEG", progressive=True, quality=75)
    segments = _segments(data)
    _, start, end = [segment for segment in segments if segment[0] == 0xDA][-1]
    eoi = segments[-1][1]
    return data[:eoi] + data[start:end] * repeats + data[eoi:]


def jpeg_restart_every_block(side: int = SIDE) -> bytes:
    """A baseline JPEG with a restart marker after every MCU (a million markers)."""
    return encode(noise(side // 4, side // 4, "L"), "JPEG", quality=90, restart_marker_blocks=1)


# --- PNG ------------------------------------------------------------------------------------------------


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_many_chunks(count: int, kind: bytes = b"IDAT") -> bytes:
    """A 1x1 PNG whose image data is cut into ``count`` chunks (empty ones after the first): Pillow reads
    chunks one at a time in Python."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
    pixels = png_chunk(b"IDAT", zlib.compress(b"\x00\x00"))
    filler = png_chunk(kind, b"") * count
    return b"\x89PNG\r\n\x1a\n" + header + pixels + filler + png_chunk(b"IEND", b"")


def png_many_ancillary_chunks(count: int) -> bytes:
    """As :func:`png_many_chunks`, with private ancillary chunks before the image data (read at open)."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
    filler = png_chunk(b"prVt", b"") * count
    pixels = png_chunk(b"IDAT", zlib.compress(b"\x00\x00"))
    return b"\x89PNG\r\n\x1a\n" + header + filler + pixels + png_chunk(b"IEND", b"")


def apng_many_frames(frames: int, side: int = 64) -> bytes:
    images = [Image.new("L", (side, side), i % 256) for i in range(frames)]
    return encode(images[0], "PNG", save_all=True, append_images=images[1:])


# --- AVIF / HEIF ----------------------------------------------------------------------------------------


def avif_lying_ispe(side: int = 8192, claimed: int = 64) -> bytes:
    """An AVIF whose ``ispe`` box declares ``claimed`` x ``claimed`` over a ``side`` x ``side`` AV1 frame:
    the pixel limit reads the box, the decoder allocates the frame."""
    data = encode(Image.new("L", (side, side)), "AVIF", speed=10, quality=10)
    box = data.index(b"ispe")
    return data[: box + 8] + struct.pack(">II", claimed, claimed) + data[box + 16 :]


def heic(side: int, mode: str = "RGB") -> bytes:
    pillow_heif.register_heif_opener()
    return encode(Image.new(mode, (side, side)), "HEIF", quality=10)


# --- what each maker is called in the suite and the bench -----------------------------------------------

Maker = Callable[[], bytes]

LEGIT: dict[str, Maker] = {
    "png-L-49mp": lambda: encode(Image.new("L", (SIDE, SIDE)), "PNG"),
    "png-LA-49mp": lambda: encode(Image.new("LA", (SIDE, SIDE)), "PNG"),
    "png-RGBA-49mp": lambda: encode(Image.new("RGBA", (SIDE, SIDE)), "PNG"),
    "png-I16-49mp": lambda: encode(Image.new("I;16", (SIDE, SIDE)), "PNG"),
    "png-P-transparent-49mp": lambda: encode(Image.new("P", (SIDE, SIDE)), "PNG", transparency=0),
    "png-interlaced-RGB-49mp": lambda: encode(Image.new("RGB", (SIDE, SIDE)), "PNG", interlace=1),
    "jpeg-progressive-noise-12mp": lambda: encode(noise(4000, 3000), "JPEG", progressive=True),
    "jpeg-CMYK-49mp": lambda: encode(Image.new("CMYK", (SIDE, SIDE)), "JPEG"),
    "webp-lossless-RGBA-49mp": lambda: encode(Image.new("RGBA", (SIDE, SIDE)), "WEBP", lossless=True),
    "webp-lossy-49mp": lambda: encode(Image.new("RGB", (SIDE, SIDE)), "WEBP", quality=10),
    "tiff-deflate-RGB-49mp": lambda: encode(
        Image.new("RGB", (SIDE, SIDE)), "TIFF", compression="tiff_adobe_deflate"
    ),
    "tiff-float32-49mp": lambda: encode(
        Image.new("F", (SIDE, SIDE)), "TIFF", compression="tiff_adobe_deflate"
    ),
    "gif-49mp": lambda: encode(Image.new("P", (SIDE, SIDE)), "GIF"),
    "bmp-rle8-49mp": lambda: encode(Image.new("P", (SIDE, SIDE)), "BMP", compression=1),
    "avif-49mp": lambda: encode(Image.new("RGB", (SIDE, SIDE)), "AVIF", speed=10, quality=10),
    "heic-49mp": lambda: heic(SIDE),
}


# --- crafted by hand (Pillow does not write these) ------------------------------------------------------


def bmp_rle8_end_at_once(side: int = SIDE) -> bytes:
    """A 49-MP 8-bit RLE BMP whose data is one end-of-bitmap code: a 1 KB file, 49 MB of pixels."""
    data = b"\x00\x01"
    palette = b"\x00\x00\x00\x00" * 256
    info = struct.pack("<IiiHHIIiiII", 40, side, side, 1, 8, 1, len(data), 2835, 2835, 256, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset) + info + palette + data


def tiff_huge_tile(side: int = 256, tile: int = 65520) -> bytes:
    """A small tiled TIFF whose tiles are declared 65520 x 65520: libtiff sizes its buffer by the tile."""
    pixels = zlib.compress(b"\x00" * 16)
    tags = [
        (256, 3, 1, side),  # ImageWidth
        (257, 3, 1, side),  # ImageLength
        (258, 3, 1, 8),  # BitsPerSample
        (259, 3, 1, 8),  # Compression: deflate
        (262, 3, 1, 1),  # Photometric: black is zero
        (277, 3, 1, 1),  # SamplesPerPixel
        (322, 3, 1, tile),  # TileWidth
        (323, 3, 1, tile),  # TileLength
        (324, 4, 1, 8),  # TileOffsets: the data right after the header
        (325, 4, 1, len(pixels)),  # TileByteCounts
    ]
    ifd_offset = 8 + len(pixels)
    ifd = struct.pack("<H", len(tags)) + b"".join(
        struct.pack("<HHI", tag, kind, count)
        + (struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value))
        for tag, kind, count, value in tags
    )
    return b"II*\x00" + struct.pack("<I", ifd_offset) + pixels + ifd + b"\x00\x00\x00\x00"


def _frames(count: int, side: int, mode: str = "L") -> list[Image.Image]:
    return [Image.new(mode, (side, side), i % 256) for i in range(count)]


def animated(image_format: str, count: int, side: int, **options: object) -> bytes:
    frames = _frames(count, side, "RGB" if image_format in ("WEBP", "AVIF") else "L")
    return encode(frames[0], image_format, save_all=True, append_images=frames[1:], **options)


def gif_declaring(side: int) -> bytes:
    """An 8x8 GIF whose screen and frame descriptors declare ``side`` x ``side`` (54 bytes)."""
    data = bytearray(encode(Image.new("L", (8, 8)), "GIF"))
    data[6:10] = struct.pack("<HH", side, side)
    frame = data.index(b"\x2c", 13)  # the image descriptor
    data[frame + 5 : frame + 9] = struct.pack("<HH", side, side)
    return bytes(data)


def _png(header: bytes, stream: bytes) -> bytes:
    """A PNG of one IHDR and one IDAT chunk."""
    chunks = png_chunk(b"IHDR", header) + png_chunk(b"IDAT", stream) + png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def png_zlib_bomb(megabytes: int) -> bytes:
    """A 1x1 grey PNG whose IDAT stream inflates to ``megabytes`` MB beyond its one pixel (~1 KB per MB)."""
    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    stream = zlib.compress(b"\x00\x80" + bytes(megabytes * 1024**2), 9)
    return _png(header, stream)


def png_palette_without_plte(side: int = 16) -> bytes:
    """A palette PNG with no PLTE chunk: indexes into a palette that is not there."""
    header = struct.pack(">IIBBBBB", side, side, 8, 3, 0, 0, 0)
    stream = zlib.compress(b"".join(b"\x00" + bytes(side) for _ in range(side)))
    return _png(header, stream)


def tiff_strip_past_the_end() -> bytes:
    """A 64x64 TIFF whose strip offset points 2 GB past the end of its 4 KB file."""
    data = bytearray(encode(Image.new("L", (64, 64)), "TIFF"))
    directory = struct.unpack("<I", data[4:8])[0]
    for entry in range(struct.unpack("<H", data[directory : directory + 2])[0]):
        at = directory + 2 + 12 * entry
        if struct.unpack("<H", data[at : at + 2])[0] == 273:  # StripOffsets
            data[at + 8 : at + 12] = struct.pack("<I", 0x7FFFFFF0)
    return bytes(data)


def webp_riff_size_lies() -> bytes:
    """A 64x64 WebP whose RIFF header says the file is 4 GB."""
    data = bytearray(encode(Image.new("RGB", (64, 64)), "WEBP"))
    data[4:8] = struct.pack("<I", 0xFFFFFFF0)
    return bytes(data)


HOSTILE: dict[str, Maker] = {
    # the attacks of issue 24
    "jpeg-progressive-1k-scans": lambda: jpeg_repeated_scan(1000),
    "jpeg-progressive-10k-scans": lambda: jpeg_repeated_scan(10_000),
    "png-1.5m-idat-chunks": lambda: png_many_chunks(1_500_000),
    "avif-ispe-64-over-8192": avif_lying_ispe,
    # beyond it
    "png-1.5m-ancillary-chunks": lambda: png_many_ancillary_chunks(1_500_000),
    "apng-2000-frames": lambda: apng_many_frames(2000),
    "jpeg-restart-every-mcu": jpeg_restart_every_block,
    "jpeg-progressive-100k-scans-small": lambda: jpeg_repeated_scan(100_000, side=512),
    "gif-20k-frames": lambda: animated("GIF", 20_000, 16),
    "webp-animated-300-frames-2000px": lambda: animated("WEBP", 300, 2000, lossless=True),
    "avif-animated-100-frames-2000px": lambda: animated("AVIF", 100, 2000, speed=10, quality=10),
    "tiff-10k-pages": lambda: animated("TIFF", 10_000, 16),
    "tiff-tile-65520": tiff_huge_tile,
    "bmp-rle8-49mp-1kb": bmp_rle8_end_at_once,
    "bmp-rle8-declares-2gp": lambda: bmp_rle8_end_at_once(46_000),
    "heic-49mp-tiny": lambda: heic(SIDE),
    "ico-256": lambda: encode(Image.new("RGB", (256, 256)), "ICO"),
    "psd-like-unknown": lambda: b"8BPS" + bytes(100),
    "tiff-LAB-49mp": lambda: encode(Image.new("LAB", (SIDE, SIDE)), "TIFF", compression="tiff_adobe_deflate"),
    "webp-over-limit-16383x4000": lambda: encode(Image.new("RGB", (16383, 4000)), "WEBP", quality=10),
    "jpeg-truncated-progressive-49mp": lambda: jpeg_repeated_scan(1)[:5000],
    "gif-declares-65535x65535": lambda: gif_declaring(65535),
    "png-1x1-idat-inflates-to-200mb": lambda: png_zlib_bomb(200),
    "png-palette-without-plte": png_palette_without_plte,
    "tiff-strip-offset-past-the-end": tiff_strip_past_the_end,
    "webp-riff-size-4gb": webp_riff_size_lies,
}
