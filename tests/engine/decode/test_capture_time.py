"""When a photo was taken: EXIF capture time with its offset, else the file's time; kept by build-index,
read once for items of indexes from before, and searchable by the camera's clock."""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
from pathlib import Path

import pillow_heif
import pytest
from PIL import ExifTags, Image

from bench.lib.images import make_image
from engine.build.indexing import build_index
from engine.decode.capture_time import capture_time, photo_time
from engine.model.embedder import Embedder
from index.filters import ItemFilter
from index.gallery import GalleryIndex

FILE_TIME = dt.datetime(2023, 3, 4, 5, 6, 7).timestamp()  # this machine's clock


def _exif(time: str | None, offset: str | None = None, digitized: str | None = None) -> Image.Exif:
    exif = Image.Exif()
    exif[ExifTags.Base.DateTime] = "2030:01:01 00:00:00"  # IFD0's time: when software last wrote the file
    sub = exif.get_ifd(ExifTags.IFD.Exif)
    if time is not None:
        sub[ExifTags.Base.DateTimeOriginal] = time
    if offset is not None:
        sub[ExifTags.Base.OffsetTimeOriginal] = offset
    if digitized is not None:
        sub[ExifTags.Base.DateTimeDigitized] = digitized
    return exif


def _photo(path: Path, seed: int, exif: Image.Exif | None = None, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = make_image(seed, size=(64, 48))
    if fmt == "HEIF":
        pillow_heif.from_pillow(image).save(path, exif=exif.tobytes() if exif else None)
    else:
        image.save(path, **({"exif": exif} if exif is not None else {}))
    os.utime(path, (FILE_TIME, FILE_TIME))
    return path


@pytest.mark.parametrize(
    ("exif", "expected"),
    [
        (_exif("2024:06:01 00:30:00", "+09:00"), "2024-06-01T00:30:00+09:00"),
        (_exif("2024:06:01 00:30:00"), "2024-06-01T00:30:00"),  # no offset written: the clock time alone
        (_exif("2024:06:01 00:30:00", "bogus"), "2024-06-01T00:30:00"),
        (_exif(None, digitized="2024:05:02 10:00:00"), "2024-05-02T10:00:00"),
        (_exif("0000:00:00 00:00:00"), None),  # a camera without a set clock
        (_exif("    :  :     :  :  "), None),
        (_exif(None), None),  # IFD0's DateTime says when the file was edited, not when it was shot
    ],
)
def test_capture_time_from_exif(tmp_path: Path, exif: Image.Exif, expected: str | None) -> None:
    path = _photo(tmp_path / "p.jpg", 1, exif)
    with Image.open(path) as image:
        assert capture_time(image) == expected
    file_clock = dt.datetime.fromtimestamp(FILE_TIME).isoformat()
    assert photo_time(path).startswith(expected or file_clock)


def test_photo_time_reads_heic_and_png_and_falls_back_to_the_file_time(tmp_path: Path) -> None:
    heic = _photo(tmp_path / "p.heic", 2, _exif("2022:12:24 18:00:00", "-05:00"), fmt="HEIF")
    assert photo_time(heic) == "2022-12-24T18:00:00-05:00"
    png = _photo(tmp_path / "p.png", 3, _exif("2021:01:02 03:04:05"))
    assert photo_time(png) == "2021-01-02T03:04:05"
    plain = _photo(tmp_path / "plain.png", 4)
    expected = dt.datetime.fromtimestamp(FILE_TIME).astimezone().isoformat()
    assert photo_time(plain) == expected
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not an image")
    os.utime(broken, (FILE_TIME, FILE_TIME))
    assert photo_time(broken) == expected


def test_build_index_keeps_capture_times_and_dates_items_of_older_indexes(
    embedder: Embedder, tmp_path: Path
) -> None:
    gallery = tmp_path / "photos"
    _photo(gallery / "trip" / "tokyo.jpg", 1, _exif("2024:06:01 00:30:00", "+09:00"))
    _photo(gallery / "trip" / "home.jpg", 2, _exif("2024:05:31 23:00:00"))
    _photo(gallery / "scan.png", 3)
    out = tmp_path / "index"
    build_index(gallery, embedder, out, progress=False)

    def taken() -> dict[str, str | None]:
        index = GalleryIndex.open(out)
        try:
            return {item.path: item.taken for item in index.items.scan()}
        finally:
            index.close()

    expected = {
        "trip/tokyo.jpg": "2024-06-01T00:30:00+09:00",
        "trip/home.jpg": "2024-05-31T23:00:00",
        "scan.png": dt.datetime.fromtimestamp(FILE_TIME).astimezone().isoformat(),
    }
    assert taken() == expected
    index = GalleryIndex.open(out)
    june = index.search(index.vectors([1, 2, 3]), 3, ItemFilter(taken_from=dt.datetime(2024, 6, 1)))
    index.close()
    # On the camera's clock Tokyo's photo is of 1 June (in UTC it is still 31 May); home's is not.
    assert {hit.item.path for row in june for hit in row} == {"trip/tokyo.jpg"}

    with sqlite3.connect(out / "items.sqlite") as connection:  # as an index from before capture times
        connection.execute("UPDATE items SET taken = NULL")
    connection.close()
    report = build_index(gallery, embedder, out, progress=False)
    assert (report.indexed, report.unchanged, report.dated) == (0, 3, 3)
    assert taken() == expected
    assert build_index(gallery, embedder, out, progress=False).dated == 0  # read once


def test_reading_the_capture_time_decodes_no_pixels(tmp_path: Path) -> None:
    """A corrupt PNG stays refused by the decode after its capture time was read from the header."""
    from engine.decode.images import ImageDecodeError, load_rgb, open_image

    for exif, expected in [(None, None), (_exif("2021:01:02 03:04:05"), "2021-01-02T03:04:05")]:
        data = bytearray(_photo(tmp_path / "p.png", 5, exif).read_bytes())
        start = data.index(b"IDAT") + 40
        data[start : start + 200] = bytes(range(200))
        header = open_image(bytes(data))
        assert capture_time(header) == expected  # an eXIf chunk ahead of the pixels, or none
        with pytest.raises(ImageDecodeError, match="could not be decoded"):
            load_rgb(header)
