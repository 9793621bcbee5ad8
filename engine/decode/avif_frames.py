"""The pixels an AVIF really decodes, read from its AV1 sequence headers before any pixel is decoded.

An AVIF's size is what its ``ispe`` box says, and that is what the decoder reports (Pillow too, even after
decoding): a file whose ``ispe`` says 64x64 over a 16384x16384 AV1 frame passed the pixel limit and then
decoded the whole frame (0.6 GB). What dav1d allocates is the frame the AV1 sequence header allows
(``max_frame_width_minus_1``, ``max_frame_height_minus_1``: every frame of the stream is at most that),
so this reads those of every AV1 item the decoder decodes for the primary image: the primary item, or the
tiles of its grid (``dimg`` references), and its auxiliary images (an alpha plane: ``auxl`` references to
it). ISO/IEC 14496-12 (boxes), ISO/IEC 23008-12 (items), AV1 bitstream specification 5.3 and 5.5.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# Boxes holding other boxes that lead to the items' boxes, and those that are "full" (a version byte and
# three flag bytes before their content).
_FULL_BOXES = frozenset({b"meta", b"iinf", b"infe", b"iloc", b"pitm", b"iref"})
_OBU_SEQUENCE_HEADER = 1
# An item's data read to find its sequence header: it comes first (a temporal unit's sequence header
# OBU precedes its frames), so a few KB hold it whatever the frame's size.
_HEAD_BYTES = 4096


class AvifStructureError(ValueError):
    """The file's boxes or its AV1 sequence header could not be read."""


@dataclass
class _Items:
    primary: int | None = None
    types: dict[int, bytes] = field(default_factory=dict)
    # item id -> (construction method, extents as (offset, length)) from iloc
    locations: dict[int, tuple[int, list[tuple[int, int]]]] = field(default_factory=dict)
    references: list[tuple[bytes, int, list[int]]] = field(default_factory=list)  # (kind, from, to)
    idat: int = 0  # the offset of the idat box's content in the file


def frame_planes(data: bytes) -> list[int]:
    """The pixels of the largest frames the decoder may decode for the primary image of AVIF ``data``,
    one figure per plane set: the colour image's (its grid's tiles summed), then each auxiliary image's
    (alpha). Raises :class:`AvifStructureError` when they cannot be read."""
    items = _items(data)
    if items.primary is None:
        raise AvifStructureError("no primary item")
    auxiliary = [
        source for kind, source, targets in items.references if kind == b"auxl" and items.primary in targets
    ]
    return [_item_pixels(data, items, item) for item in (items.primary, *auxiliary)]


def _item_pixels(data: bytes, items: _Items, item: int) -> int:
    kind = items.types.get(item)
    if kind == b"grid":
        tiles = [
            target
            for k, source, targets in items.references
            if k == b"dimg" and source == item
            for target in targets
        ]
        return sum(_item_pixels(data, items, tile) for tile in tiles if items.types.get(tile) == b"av01")
    if kind != b"av01":
        raise AvifStructureError(f"item {item} is of type {kind!r}, not an AV1 image or a grid")
    width, height = sequence_header_size(_item_head(data, items, item))
    return width * height


def _boxes(data: bytes, start: int, end: int) -> list[tuple[bytes, int, int]]:
    """(type, content start, content end) of the boxes in ``data[start:end]``."""
    found = []
    while start + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, start)
        header = 8
        if size == 1:
            if start + 16 > end:
                raise AvifStructureError("a box's 64-bit size is cut off")
            size = struct.unpack_from(">Q", data, start + 8)[0]
            header = 16
        elif size == 0:
            size = end - start
        if size < header or start + size > end:
            raise AvifStructureError(f"box {kind!r} of {size} bytes does not fit its parent")
        content = start + header + (4 if kind in _FULL_BOXES else 0)
        found.append((kind, content, start + size))
        start += size
    return found


def _items(data: bytes) -> _Items:
    items = _Items()
    meta = next(((s, e) for kind, s, e in _boxes(data, 0, len(data)) if kind == b"meta"), None)
    if meta is None:
        raise AvifStructureError("no meta box")
    for kind, start, end in _boxes(data, *meta):
        version = data[start - 4] if kind in _FULL_BOXES else 0
        if kind == b"pitm":
            items.primary = _uint(data, start, 2 if version == 0 else 4)
        elif kind == b"iinf":
            skip = 2 if version == 0 else 4
            for entry, entry_start, _ in _boxes(data, start + skip, end):
                if entry == b"infe" and data[entry_start - 4] >= 2:
                    wide = data[entry_start - 4] >= 3
                    item = _uint(data, entry_start, 4 if wide else 2)
                    type_at = entry_start + (4 if wide else 2) + 2
                    items.types[item] = data[type_at : type_at + 4]
        elif kind == b"iloc":
            _read_iloc(data, start, version, items)
        elif kind == b"iref":
            width = 2 if version == 0 else 4
            for reference, ref_start, ref_end in _boxes_plain(data, start, end):
                source = _uint(data, ref_start, width)
                count = _uint(data, ref_start + width, 2)
                at = ref_start + width + 2
                if at + count * width > ref_end:
                    raise AvifStructureError("an iref entry is cut off")
                targets = [_uint(data, at + i * width, width) for i in range(count)]
                items.references.append((reference, source, targets))
        elif kind == b"idat":
            items.idat = start
    return items


def _boxes_plain(data: bytes, start: int, end: int) -> list[tuple[bytes, int, int]]:
    """:func:`_boxes` for boxes that are never full (iref's entries are named like references, not
    boxes: 'dimg', 'auxl', 'thmb'...)."""
    found = []
    while start + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, start)
        if size < 8 or start + size > end:
            raise AvifStructureError(f"an iref entry {kind!r} does not fit")
        found.append((kind, start + 8, start + size))
        start += size
    return found


def _read_iloc(data: bytes, start: int, version: int, items: _Items) -> None:
    sizes = _uint(data, start, 2)
    offset_size, length_size = sizes >> 12, (sizes >> 8) & 15
    base_offset_size, index_size = (sizes >> 4) & 15, sizes & 15 if version in (1, 2) else 0
    at = start + 2
    count_width = 2 if version < 2 else 4
    count = _uint(data, at, count_width)
    at += count_width
    for _ in range(count):
        item = _uint(data, at, count_width)
        at += count_width
        method = 0
        if version in (1, 2):
            method = _uint(data, at, 2) & 15
            at += 2
        at += 2  # data_reference_index
        base = _uint(data, at, base_offset_size)
        at += base_offset_size
        extents = []
        extent_count = _uint(data, at, 2)
        at += 2
        for _ in range(extent_count):
            at += index_size
            offset = _uint(data, at, offset_size)
            length = _uint(data, at + offset_size, length_size)
            at += offset_size + length_size
            extents.append((base + offset, length))
        items.locations[item] = (method, extents)


def _item_head(data: bytes, items: _Items, item: int) -> bytes:
    """The first bytes of ``item``'s data (its extents joined)."""
    if item not in items.locations:
        raise AvifStructureError(f"item {item} has no location")
    method, extents = items.locations[item]
    if method not in (0, 1):
        raise AvifStructureError(f"item {item}'s data is built by method {method}")
    base = items.idat if method == 1 else 0
    head = bytearray()
    for offset, length in extents:
        start = base + offset
        stop = len(data) if length == 0 else start + length
        if start > len(data) or stop > len(data):
            raise AvifStructureError(f"item {item}'s data lies past the end of the file")
        head += data[start : min(stop, start + _HEAD_BYTES - len(head))]
        if len(head) >= _HEAD_BYTES:
            break
    return bytes(head)


def _uint(data: bytes, at: int, width: int) -> int:
    if width == 0:
        return 0
    if at + width > len(data):
        raise AvifStructureError("a field is cut off")
    return int.from_bytes(data[at : at + width], "big")


# --- the AV1 sequence header ----------------------------------------------------------------------------


def sequence_header_size(stream: bytes) -> tuple[int, int]:
    """``(max_frame_width, max_frame_height)`` of the sequence header OBU that opens ``stream`` (OBUs in
    the low-overhead format an AVIF item holds, each with its size)."""
    at = 0
    while at < len(stream):
        header = stream[at]
        kind, extension, has_size = (header >> 3) & 15, header >> 2 & 1, header >> 1 & 1
        at += 1 + extension
        if not has_size:
            size = len(stream) - at
        else:
            size, at = _leb128(stream, at)
        if kind == _OBU_SEQUENCE_HEADER:
            return _frame_size(_Bits(stream[at : at + size]))
        at += size
    raise AvifStructureError("no AV1 sequence header in the item's first bytes")


def _leb128(stream: bytes, at: int) -> tuple[int, int]:
    value = 0
    for i in range(8):
        if at >= len(stream):
            raise AvifStructureError("an OBU size is cut off")
        byte = stream[at]
        at += 1
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, at
    raise AvifStructureError("an OBU size over 8 bytes")


class _Bits:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.position = 0

    def read(self, count: int) -> int:
        value = 0
        for _ in range(count):
            byte = self.position >> 3
            if byte >= len(self.data):
                raise AvifStructureError("the AV1 sequence header is cut off")
            value = value << 1 | (self.data[byte] >> (7 - (self.position & 7))) & 1
            self.position += 1
        return value

    def uvlc(self) -> int:
        zeros = 0
        while not self.read(1):
            zeros += 1
            if zeros >= 32:
                return (1 << 32) - 1
        return self.read(zeros) + (1 << zeros) - 1


def _frame_size(bits: _Bits) -> tuple[int, int]:
    """AV1 specification 5.5.1, up to max_frame_height_minus_1."""
    bits.read(3)  # seq_profile
    bits.read(1)  # still_picture
    if bits.read(1):  # reduced_still_picture_header
        bits.read(5)  # seq_level_idx[0]
    else:
        decoder_model_info = False
        buffer_delay_length = 0
        if bits.read(1):  # timing_info_present_flag
            bits.read(32)  # num_units_in_display_tick
            bits.read(32)  # time_scale
            if bits.read(1):  # equal_picture_interval
                bits.uvlc()  # num_ticks_per_picture_minus_1
            decoder_model_info = bool(bits.read(1))
            if decoder_model_info:
                buffer_delay_length = bits.read(5) + 1
                bits.read(32)  # num_units_in_decoding_tick
                bits.read(5)  # buffer_removal_time_length_minus_1
                bits.read(5)  # frame_presentation_time_length_minus_1
        initial_display_delay = bits.read(1)
        for _ in range(bits.read(5) + 1):  # operating points
            bits.read(12)  # operating_point_idc
            if bits.read(5) > 7:  # seq_level_idx
                bits.read(1)  # seq_tier
            if decoder_model_info and bits.read(1):  # decoder_model_present_for_this_op
                bits.read(2 * buffer_delay_length + 1)
            if initial_display_delay and bits.read(1):
                bits.read(4)  # initial_display_delay_minus_1
    width_bits, height_bits = bits.read(4) + 1, bits.read(4) + 1
    return bits.read(width_bits) + 1, bits.read(height_bits) + 1
