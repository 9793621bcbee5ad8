"""Search by a region: a box drawn on the query image, checked against the upright image and cropped from it
after decoding (and EXIF rotation), before the model's resize.

A box is ``x0,y0,x1,y1``: the left, top, right and bottom edges, in pixels of the upright image (as a viewer
shows it, after EXIF rotation), or as fractions of its width and height when all four are within [0, 1] (a
box of pixels that small would be refused as too small anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import ExifTags, Image

from engine.decode.images import ImageDecodeError, draft_jpeg
from foundation.defaults import MIN_BOX_SIDE
from foundation.errors import ErrorKind

# EXIF orientations that turn the image by 90 degrees (width and height swap when it is made upright).
_QUARTER_TURNS = frozenset({5, 6, 7, 8})


class BoxError(ImageDecodeError):
    """A box that is malformed, inverted, outside its image or too small; ``code`` says which. The image
    is fine: the box does not fit it (422)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.kind = ErrorKind.INVALID

    def __reduce__(self) -> tuple[type[BoxError], tuple[str, str]]:
        return BoxError, (self.code, self.message)  # raised in a decode process, re-raised here


# What a box is, in words: every refusal of a malformed one says it (the API, the command line).
BOX_FORMAT = (
    "four numbers x0,y0,x1,y1 (left, top, right, bottom), in pixels of the upright image or as fractions "
    "of its width and height, e.g. 40,30,200,180 or 0.25,0.2,0.75,0.8"
)


@dataclass(frozen=True)
class Box:
    x0: float
    y0: float
    x1: float
    y1: float

    @classmethod
    def parse(cls, text: str) -> Box:
        """``"x0,y0,x1,y1"`` as a box; raises :class:`BoxError` (``invalid_box``, ``box_inverted``)."""
        parts = text.split(",")
        try:
            values = [float(part) for part in parts]
        except ValueError:
            values = []
        if len(parts) != 4 or len(values) != 4 or not all(map(math.isfinite, values)):
            raise BoxError("invalid_box", f"box {text!r} is not {BOX_FORMAT}")
        box = cls(*values)
        if box.x0 >= box.x1 or box.y0 >= box.y1:
            raise BoxError(
                "box_inverted",
                f"box {text!r} is inverted or empty: x0 < x1 and y0 < y1 are needed "
                "(left, top, right, bottom)",
            )
        return box

    @property
    def fractional(self) -> bool:
        return all(0.0 <= value <= 1.0 for value in (self.x0, self.y0, self.x1, self.y1))

    def __str__(self) -> str:
        return ",".join(f"{value:g}" for value in (self.x0, self.y0, self.x1, self.y1))

    def pixels(self, width: int, height: int, *, min_side: int = MIN_BOX_SIDE) -> tuple[float, ...]:
        """The box in pixels of an upright ``width`` x ``height`` image; raises :class:`BoxError`
        (``box_outside_image``, ``box_too_small``)."""
        if self.fractional:
            box = (self.x0 * width, self.y0 * height, self.x1 * width, self.y1 * height)
        else:
            box = (self.x0, self.y0, self.x1, self.y1)
            if min(box) < 0 or box[2] > width or box[3] > height:
                raise BoxError(
                    "box_outside_image",
                    f"box {self} reaches outside the {width}x{height} image (upright, after EXIF rotation): "
                    f"pixels run from 0,0 to {width},{height}",
                )
        # A side as long as the image's is never too small (a whole small image is a fine query).
        if (box[2] - box[0] < min(min_side, width)) or (box[3] - box[1] < min(min_side, height)):
            size = f"{box[2] - box[0]:g}x{box[3] - box[1]:g}"
            raise BoxError(
                "box_too_small",
                f"box {self} is {size} pixels of the {width}x{height} image, "
                f"less than the minimum of {min_side}x{min_side}",
            )
        return box


@dataclass(frozen=True)
class Crop:
    """A checked box in pixels of the full-size upright image, to cut from the image as decoded (which a
    JPEG draft may have made smaller)."""

    box: tuple[float, ...]
    full_size: tuple[int, int]

    def apply(self, image: Image.Image) -> Image.Image:
        scale_x, scale_y = image.width / self.full_size[0], image.height / self.full_size[1]
        x0, y0, x1, y1 = self.box
        return image.crop(
            (round(x0 * scale_x), round(y0 * scale_y), round(x1 * scale_x), round(y1 * scale_y))
        )


def upright_size(header: Image.Image) -> tuple[int, int]:
    """An image's size as shown, after the EXIF rotation :func:`engine.decode.images.load_rgb` applies (read
    from
    its header; HEIF decoders rotate already and clear the tag)."""
    orientation = header.getexif().get(ExifTags.Base.Orientation, 1)
    width, height = header.size
    return (height, width) if orientation in _QUARTER_TURNS else (width, height)


def crop_for(header: Image.Image, box: Box, draft_size: int | None, draft_margin: int) -> Crop:
    """Check ``box`` against a full-size header from :func:`engine.decode.images.open_image` (opened without
    draft) and set its JPEG draft so that the region, not the whole image, keeps ``draft_margin *
    draft_size`` pixels on its shorter side; raises :class:`BoxError`."""
    full = upright_size(header)
    pixels = box.pixels(*full)
    if draft_size is not None:
        shrink = min(pixels[2] - pixels[0], pixels[3] - pixels[1]) / (draft_margin * draft_size)
        if shrink > 1:
            width, height = header.size
            draft_jpeg(header, (math.ceil(width / shrink), math.ceil(height / shrink)))
    return Crop(pixels, full)
