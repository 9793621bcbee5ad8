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


def with_ispe(data: bytes, claimed: int) -> bytes:
    """``data`` (a HEIF or an AVIF) with every ``ispe`` box saying ``claimed`` x ``claimed``."""
    lie = bytearray(data)
    box = lie.find(b"ispe")
    while box >= 0:
        lie[box + 8 : box + 16] = struct.pack(">II", claimed, claimed)
        box = lie.find(b"ispe", box + 4)
    return bytes(lie)


def heic_lying_ispe(side: int = 8192, claimed: int = 64) -> bytes:
    """A HEIC whose ``ispe`` says ``claimed`` x ``claimed`` over a ``side`` x ``side`` HEVC frame (x265's
    fastest preset: the frame's size is the lie, and the default preset spent 15 s of CPU on 8192 x 8192)."""
    pillow_heif.register_heif_opener()
    options = {"quality": 10, "enc_params": {"preset": "ultrafast"}}
    return with_ispe(encode(Image.new("L", (side, side)), "HEIF", **options), claimed)


def avif_rgba_lying_ispe(side: int = 2048, claimed: int = 64) -> bytes:
    """An AVIF with an alpha plane (a second AV1 item, ``auxl``), both ``ispe`` boxes lying."""
    return with_ispe(encode(Image.new("RGBA", (side, side)), "AVIF", speed=10, quality=10), claimed)


def avif_without_sequence_header(side: int = 256) -> bytes:
    """An AVIF whose AV1 item's sequence header OBU is renamed into padding (OBU type 15): its frames'
    size cannot be read from it."""
    data = bytearray(encode(Image.new("L", (side, side)), "AVIF", speed=10, quality=10))
    header = data.index(b"mdat") + 4 + 2  # after the temporal delimiter OBU (2 bytes) that opens the item
    assert (data[header] >> 3) & 15 == 1, "libavif's item no longer opens with a sequence header"
    data[header] = (data[header] & 0b10000111) | (15 << 3)
    return bytes(data)


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


# --- the second attack (bench/attack.py; bench/results/attack_session13.md) ------------------------------


def _jpeg_with_segments(segment: bytes, count: int, image: Image.Image | None = None) -> bytes:
    """A small JPEG with ``count`` copies of ``segment`` (a whole marker segment) right after its SOI."""
    data = encode(image or Image.new("L", (16, 16)), "JPEG")
    return data[:2] + segment * count + data[2:]


def jpeg_segment(marker: int, body: bytes) -> bytes:
    return struct.pack(">BBH", 0xFF, marker, len(body) + 2) + body


def jpeg_many_dht(count: int) -> bytes:
    """``count`` copies of a full Huffman table segment before the frame: libjpeg parses each one."""
    data = encode(Image.new("L", (16, 16)), "JPEG")
    _, start, end = next(segment for segment in _segments(data) if segment[0] == 0xC4)
    return data[:start] + data[start:end] * count + data[start:]


def jpeg_icc_chunks(count: int) -> bytes:
    """``count`` APP2 ICC_PROFILE chunks, each claiming to be chunk 1 of 255 (Pillow gathers them)."""
    body = b"ICC_PROFILE\x00" + bytes([1, 255]) + bytes(60_000)
    return _jpeg_with_segments(jpeg_segment(0xE2, body), count)


def tiff_exif(entries: list[tuple[int, int, int, bytes]], next_ifd: int = 0) -> bytes:
    """A little-endian TIFF header and one IFD of ``(tag, type, count, 4-byte value)`` at offset 8."""
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHI", tag, kind, count) + value for tag, kind, count, value in entries
    )
    return b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", next_ifd)


def exif_ifd_loop() -> bytes:
    """EXIF whose first IFD points to itself as the next one, and whose ExifIFD pointer points back to it."""
    return tiff_exif([(0x0112, 3, 1, b"\x06\x00\x00\x00"), (0x8769, 4, 1, struct.pack("<I", 8))], next_ifd=8)


def exif_many_entries(count: int = 65535) -> bytes:
    """EXIF whose IFD declares 65535 entries (each a LONG array pointing past the end of the block)."""
    return tiff_exif(
        [(0x9000 + i % 1000, 4, 0x3FFFFFFF, struct.pack("<I", 0x7FFFFFF0)) for i in range(count)]
    )


def jpeg_with_exif(exif: bytes, image: Image.Image | None = None) -> bytes:
    return encode(image or Image.new("L", (16, 16)), "JPEG", exif=b"Exif\x00\x00" + exif)


def jpeg_orientation_49mp() -> bytes:
    """A 49-MP JPEG with EXIF orientation 6 (rotate): exif_transpose makes a rotated copy of every pixel."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(Image.new("L", (SIDE, SIDE)), "JPEG", exif=exif.tobytes(), quality=10)


def mpo_declaring(images: int = 65535) -> bytes:
    """A JPEG whose APP2 MPF index declares ``images`` pictures, every offset past the end of the file."""
    entries = struct.pack("<IIIHH", 0x20030000, 0x7FFFFFF0, 0x7FFFFFF0, 0, 0) * images
    index = [
        (0xB000, 7, 4, b"0100"),
        (0xB001, 4, 1, struct.pack("<I", images)),
        (0xB002, 7, len(entries), struct.pack("<I", 50)),
    ]
    body = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", len(index))
    body += b"".join(struct.pack("<HHI", tag, kind, count) + value for tag, kind, count, value in index)
    body += b"\x00\x00\x00\x00" + entries
    return _jpeg_with_segments(jpeg_segment(0xE2, b"MPF\x00" + body[: 65533 - 4]), 1)


def jpeg_lossless_49mp() -> bytes:
    """A lossless (SOF3) JPEG declaring 49 MP over almost no data: libjpeg-turbo 3 decodes SOF3."""
    data = bytearray(encode(Image.new("L", (16, 16)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 1] = 0xC3
    data[sof + 5 : sof + 9] = struct.pack(">HH", SIDE, SIDE)
    return bytes(data)


def png_exif_loop() -> bytes:
    """A PNG whose eXIf chunk is an IFD loop with an orientation: read when the orientation is applied."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0))
    stream = png_chunk(b"IDAT", zlib.compress(b"".join(b"\x00" + bytes(8) for _ in range(8))))
    return (
        b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"eXIf", exif_ifd_loop()) + stream + png_chunk(b"IEND", b"")
    )


def apng_frame_outside(side: int = 64) -> bytes:
    """An APNG whose second frame's fcTL puts a 65535x65535 frame at (2^31, 2^31)."""
    data = bytearray(apng_many_frames(2, side))
    second = data.index(b"fcTL", data.index(b"IDAT"))
    body = struct.pack(">IIIII", 1, 65535, 65535, 2**31, 2**31) + bytes(data[second + 24 : second + 30])
    chunk = png_chunk(b"fcTL", body)
    return bytes(data[: second - 4]) + chunk + bytes(data[second + 4 + 26 + 4 :])


def png_16bit_rgba(side: int = SIDE) -> bytes:
    """A 49-MP 16-bit RGBA PNG (one row, repeated by zlib): Pillow decodes it to 8-bit RGBA."""
    header = struct.pack(">IIBBBBB", side, side, 16, 6, 0, 0, 0)
    compressor = zlib.compressobj(9)
    row = b"\x00" + bytes(side * 8)
    stream = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    return _png(header, stream)


def gif_many_comment_blocks(count: int) -> bytes:
    """An 8x8 GIF with a comment extension of ``count`` one-byte sub-blocks before its image."""
    data = encode(Image.new("L", (8, 8)), "GIF")
    frame = data.index(b"\x2c", 13)
    comment = b"\x21\xfe" + b"\x01x" * count + b"\x00"
    return data[:frame] + comment + data[frame:]


def gif_frame_offset(offset: int = 65000) -> bytes:
    """A GIF of a 1x1 screen whose one 1x1 frame sits at (``offset``, ``offset``)."""
    data = bytearray(encode(Image.new("L", (1, 1)), "GIF"))
    frame = data.index(b"\x2c", 13)
    data[frame + 1 : frame + 5] = struct.pack("<HH", offset, offset)
    return bytes(data)


def gif_lzw_clear_codes(count: int) -> bytes:
    """A 1x1 GIF whose image data is ``count`` LZW clear codes: the decoder loops over them all."""
    data = encode(Image.new("L", (1, 1)), "GIF")
    frame = data.index(b"\x2c", 13)
    minimum = 8  # 9-bit codes; the clear code is 256: 9 of them fit in 81 bits
    codes = bytearray()
    bits, value = 0, 0
    for _ in range(count):
        value |= 256 << bits
        bits += 9
        while bits >= 8:
            codes.append(value & 0xFF)
            value >>= 8
            bits -= 8
    blocks = b"".join(
        bytes([len(part)]) + part for part in (codes[i : i + 255] for i in range(0, len(codes), 255))
    )
    descriptor = data[frame : frame + 10]
    return data[:frame] + descriptor + bytes([minimum]) + bytes(blocks) + b"\x00\x3b"


def tiff_ifd(entries: list[tuple[int, int, int, int]], pixels: bytes) -> bytes:
    """A little-endian TIFF: the pixel data at offset 8, then one IFD of SHORT/LONG entries."""
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHI", tag, kind, count)
        + (struct.pack("<HH", value, 0) if kind == 3 else struct.pack("<I", value))
        for tag, kind, count, value in entries
    )
    return b"II*\x00" + struct.pack("<I", 8 + len(pixels)) + pixels + ifd + b"\x00\x00\x00\x00"


def tiff_many_strips(strips: int = 200_000) -> bytes:
    """A 1 x ``strips`` TIFF of one-row strips: two arrays of ``strips`` offsets and counts."""
    offsets = struct.pack(f"<{strips}I", *([8] * strips))
    counts = struct.pack(f"<{strips}I", *([1] * strips))
    pixels = b"\x00" * 8
    arrays_at = 8 + len(pixels)
    entries = [
        (256, 3, 1, 1),
        (257, 4, 1, strips),
        (258, 3, 1, 8),
        (259, 3, 1, 1),
        (262, 3, 1, 1),
        (277, 3, 1, 1),
        (278, 3, 1, 1),  # RowsPerStrip
        (273, 4, strips, arrays_at),
        (279, 4, strips, arrays_at + len(offsets)),
    ]
    body = pixels + offsets + counts
    return tiff_ifd(entries, body)


def tiff_ifd_loop() -> bytes:
    """A 16x16 TIFF whose next-IFD offset points back to its own IFD: an endless chain of pages."""
    data = bytearray(encode(Image.new("L", (16, 16)), "TIFF"))
    directory = struct.unpack("<I", data[4:8])[0]
    entries = struct.unpack("<H", data[directory : directory + 2])[0]
    at = directory + 2 + 12 * entries
    data[at : at + 4] = struct.pack("<I", directory)
    return bytes(data)


def tiff_tag_declaring_4gb() -> bytes:
    """A 16x16 TIFF with one more tag whose LONG array of 2^30 values (4 GB) lies past the end."""
    pixels = bytes(256)
    entries = [
        (256, 3, 1, 16),
        (257, 3, 1, 16),
        (258, 3, 1, 8),
        (259, 3, 1, 1),
        (262, 3, 1, 1),
        (273, 4, 1, 8),
        (277, 3, 1, 1),
        (279, 4, 1, 256),
        (33432, 4, 2**30, 0x100),  # Copyright, as 4 GB of LONGs
    ]
    return tiff_ifd(entries, pixels)


def tiff_planar_separate_49mp() -> bytes:
    return encode(
        Image.new("RGB", (SIDE, SIDE)), "TIFF", compression="tiff_adobe_deflate", planar_configuration=2
    )


def tiff_1bit_49mp() -> bytes:
    return encode(Image.new("1", (SIDE, SIDE)), "TIFF", compression="group4")


def bmp_rle4_deltas(side: int = SIDE) -> bytes:
    """A 49-MP 4-bit RLE BMP made of delta escapes that jump ahead 255 pixels at a time, then past the end."""
    data = b"\x00\x02\xff\x00" * 1000 + b"\x00\x02\xff\xff" * 100 + b"\x00\x01"
    palette = b"\x00\x00\x00\x00" * 16
    info = struct.pack("<IiiHHIIiiII", 40, side, side, 1, 4, 2, len(data), 2835, 2835, 16, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset) + info + palette + data


def bmp_height(height: int, width: int = 16) -> bytes:
    """An 8-bit BMP whose height field is ``height`` (negative: top-down)."""
    pixels = bytes(width * 16)
    palette = b"\x00\x00\x00\x00" * 256
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 0, len(pixels), 2835, 2835, 256, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + palette + pixels


def bmp_palette_count(colours: int = 0x7FFFFFFF) -> bytes:
    """A 16x16 8-bit BMP whose header says its palette has ``colours`` entries."""
    data = bytearray(bmp_height(16))
    data[14 + 32 : 14 + 36] = struct.pack("<I", colours)
    return bytes(data)


def webp_exif_loop() -> bytes:
    return encode(Image.new("RGB", (16, 16)), "WEBP", exif=exif_ifd_loop())


def heic_many_images(count: int = 64, side: int = 64) -> bytes:
    pillow_heif.register_heif_opener()
    frames = _frames(count, side, "RGB")
    return encode(frames[0], "HEIF", save_all=True, append_images=frames[1:], quality=10)


def jpeg_html_polyglot() -> bytes:
    """A valid JPEG with an HTML page with a script after its end: served back, it must not be sniffed."""
    return (
        encode(Image.new("RGB", (16, 16)), "JPEG") + b"<html><script>alert(document.domain)</script></html>"
    )


def eps_document() -> bytes:
    """An EPS file: Pillow would hand it to Ghostscript if it were ever loaded."""
    return b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n0 0 moveto showpage\n%%EOF\n"


def png_comment_text(kilobytes: int) -> bytes:
    """An 8x8 PNG with a tEXt chunk keyed "comment" of ``kilobytes`` KB (Pillow: ``info["comment"]``)."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0))
    text = png_chunk(b"tEXt", b"comment\x00" + b"x" * kilobytes * 1024)
    stream = png_chunk(b"IDAT", zlib.compress(b"".join(b"\x00" + bytes(8) for _ in range(8))))
    return b"\x89PNG\r\n\x1a\n" + header + text + stream + png_chunk(b"IEND", b"")


# The second attack (bench/attack.py, bench/results/attack_session13.md): formats and tricks not above.
HOSTILE_SECOND: dict[str, Maker] = {
    "jpeg-100k-huffman-tables": lambda: jpeg_many_dht(100_000),
    "jpeg-300-icc-chunks-18mb": lambda: jpeg_icc_chunks(300),
    "jpeg-exif-ifd-loop": lambda: jpeg_with_exif(exif_ifd_loop()),
    "jpeg-exif-65535-entries-4gb-arrays": lambda: jpeg_with_exif(exif_many_entries()[:65000]),
    "jpeg-exif-rotate-49mp": jpeg_orientation_49mp,
    "mpo-index-declares-65535-pictures": mpo_declaring,
    "jpeg-lossless-sof3-declares-49mp": jpeg_lossless_49mp,
    "png-exif-ifd-loop": png_exif_loop,
    "apng-frame-at-2^31": apng_frame_outside,
    "png-16bit-rgba-49mp": png_16bit_rgba,
    "png-text-comment-1mb": lambda: png_comment_text(1024),
    "gif-1m-comment-subblocks": lambda: gif_many_comment_blocks(1_000_000),
    "gif-frame-at-65000": gif_frame_offset,
    "gif-1m-lzw-clear-codes": lambda: gif_lzw_clear_codes(1_000_000),
    "tiff-200k-strips": tiff_many_strips,
    "tiff-2m-strips-16mb": lambda: tiff_many_strips(2_000_000),
    "tiff-ifd-loop": tiff_ifd_loop,
    "tiff-tag-declares-4gb": tiff_tag_declaring_4gb,
    "tiff-planar-separate-49mp": tiff_planar_separate_49mp,
    "tiff-1bit-g4-49mp": tiff_1bit_49mp,
    "bmp-rle4-deltas-49mp": bmp_rle4_deltas,
    "bmp-height-int-min": lambda: bmp_height(-(2**31)),
    "bmp-palette-2g-colours": bmp_palette_count,
    "webp-exif-ifd-loop": webp_exif_loop,
    "heic-64-images": heic_many_images,
    "jpeg-html-polyglot": jpeg_html_polyglot,
    "eps-ghostscript": eps_document,
    "jpeg2000": lambda: encode(Image.new("RGB", (64, 64)), "JPEG2000"),
    "cur-cursor": lambda: b"\x00\x00\x02\x00" + encode(Image.new("RGB", (32, 32)), "ICO")[4:],
    "empty": lambda: b"",
    "one-byte": lambda: b"\xff",
    "jpeg-soi-only": lambda: b"\xff\xd8",
}
