"""When a photo was taken: its EXIF capture time, else the file's modification time.

Values are ``index.protocol.Item.taken``'s form, the camera's clock time "YYYY-MM-DDTHH:MM:SS" followed by
the UTC offset when it is known ("+02:00"), which is what ``index.filters`` compares.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from PIL import ExifTags, Image

from engine.decode.images import image_header

# (time, its UTC offset) tags of the EXIF sub-IFD, most telling first (EXIF 2.31 added the offsets).
_CAPTURE_TAGS = (
    (ExifTags.Base.DateTimeOriginal, ExifTags.Base.OffsetTimeOriginal),
    (ExifTags.Base.DateTimeDigitized, ExifTags.Base.OffsetTimeDigitized),
)
_OFFSET = re.compile(r"[+-]\d\d:\d\d")


def capture_time(image: Image.Image) -> str | None:
    """The EXIF capture time of an opened image (its header is enough), or None where it has none.

    Blank or malformed values ("0000:00:00 00:00:00", as some cameras write without a set clock) are none.
    """
    try:
        exif = _header_exif(image).get_ifd(ExifTags.IFD.Exif)
    except Exception:  # untrusted bytes: a broken EXIF block is no capture time, not a broken image
        return None
    for time_tag, offset_tag in _CAPTURE_TAGS:
        time = _parse(exif.get(time_tag))
        if time is not None:
            offset = str(exif.get(offset_tag) or "").strip("\x00 ")
            return time.isoformat(timespec="seconds") + (offset if _OFFSET.fullmatch(offset) else "")
    return None


def camera_name(image: Image.Image) -> str | None:
    """The camera's make and model from an opened image's EXIF (its header is enough), or None where it
    names none: what a re-save without care drops, and a byte copy keeps."""
    try:
        exif = _header_exif(image)
        parts = [str(exif.get(tag) or "").strip("\x00 ") for tag in (ExifTags.Base.Make, ExifTags.Base.Model)]
    except Exception:  # untrusted bytes: a broken EXIF block names no camera
        return None
    return " ".join(part for part in parts if part) or None


def _header_exif(image: Image.Image) -> Image.Exif:
    """The image's EXIF without decoding its pixels.

    Pillow's PNG ``getexif`` decodes the whole image to look for an eXIf chunk after the pixel data, which
    here would decode an upload before its checks, and let a corrupt PNG "load" before the decode that
    must refuse it: for a PNG, only an eXIf chunk ahead of the pixels counts (where writers put it).
    """
    if image.format != "PNG":
        return image.getexif()
    exif = Image.Exif()
    if data := image.info.get("exif"):
        exif.load(data)
    return exif


def photo_time(path: Path) -> str:
    """When the photo in an image file was taken: its EXIF capture time (read from the header, no pixel is
    decoded), else the file's time."""
    with image_header(path) as image:  # None when unreadable now: the file's time is all there is
        taken = None if image is None else capture_time(image)
    return taken or file_time(path)


def file_time(path: Path) -> str:
    """The file's modification time on this machine's clock, with its offset."""
    return dt.datetime.fromtimestamp(path.stat().st_mtime).astimezone().isoformat(timespec="seconds")


def clock_now() -> str:
    """This machine's clock time now, with its offset (a file written now)."""
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _parse(value: object) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.strptime(value.strip("\x00 "), "%Y:%m:%d %H:%M:%S")
    except ValueError:
        return None
