"""Decode untrusted image bytes into RGB Pillow images, refusing anything unsafe or unreadable."""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pillow_heif
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.decode.avif_frames import AvifStructureError, frame_planes
from foundation.defaults import MAX_IMAGE_PIXELS
from foundation.errors import DmlsearchError, ErrorKind
from foundation.regular_files import read_image_file

# HEIC/HEIF (phones' default) through pillow-heif's Pillow plugin; AVIF is built into Pillow >= 11.
# libheif applies the HEIF rotation boxes and resets the EXIF orientation, so exif_transpose below never
# rotates a HEIC twice.
pillow_heif.register_heif_opener()

# Pillow format name -> the suffix a stored file of that format gets (MPO is a multi-picture JPEG).
FORMAT_SUFFIXES = {
    "JPEG": ".jpg",
    "MPO": ".jpg",
    "PNG": ".png",
    "WEBP": ".webp",
    "BMP": ".bmp",
    "GIF": ".gif",
    "TIFF": ".tif",
    "HEIF": ".heic",
    "AVIF": ".avif",
}
ALLOWED_FORMATS = frozenset(FORMAT_SUFFIXES)
# The media types of those formats, for the API's schema (MPO is a JPEG to anyone but Pillow).
IMAGE_MEDIA_TYPES = (
    "image/jpeg",
    "image/png",
    "image/webp",
    "image/bmp",
    "image/gif",
    "image/tiff",
    "image/heic",
    "image/heif",
    "image/avif",
)
# Files with these suffixes are taken as images without looking inside; any other file is recognised by
# its content (see is_image_file). Either way decoding goes by content, never by the name.
IMAGE_SUFFIXES = frozenset({*FORMAT_SUFFIXES.values(), ".jpeg", ".tiff", ".heif", ".hif"})
# JPEG draft decoding keeps twice the final size and leaves the last step to Pillow's antialiased resize:
# decoding straight down to the final size (margin 1) lost Recall@1 beyond noise (paired sign test), while
# margin 2 stayed within noise of full decoding and still decodes and preprocesses several times faster
# (bench/jpeg_draft.py on Cars196 test classes as 1600-px JPEGs: bench/results/jpeg_draft_cars196.json).
DRAFT_MARGIN = 2

# Where open_image keeps the pixels an AVIF's frames hold (engine.decode.avif_frames): its size is its
# ispe box's, which may lie.
FRAME_PIXELS = "dmlsearch_frame_pixels"

# What a decode task is given: an upload's bytes, or the path of a gallery file, which the decode process
# reads itself (within ``foundation.regular_files``' limits): a 147 MB uncompressed TIFF held whole twice
# by two requests grew the server by 561 MB, while only the downscale or the model input comes back.
ImageSource = bytes | Path


# The kind of each decode failure whose kind is not "malformed" (an image that cannot be read).
_DECODE_ERROR_KINDS = {
    "unsupported_format": ErrorKind.UNSUPPORTED,
    "image_too_large": ErrorKind.TOO_LARGE,
    "batch_too_large": ErrorKind.TOO_LARGE,
    "image_too_costly": ErrorKind.INVALID,  # its decode went over its time or memory limit
    "request_too_costly": ErrorKind.INVALID,  # a request's images went over their budget together
}


class ImageDecodeError(DmlsearchError, ValueError):
    """An input that is not a decodable, supported, reasonably sized image.

    ``code`` is a stable machine-readable reason used by the API's JSON errors.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)
        self.kind = _DECODE_ERROR_KINDS.get(code, ErrorKind.MALFORMED)

    def __reduce__(self) -> tuple[type[ImageDecodeError], tuple[str, str]]:
        return ImageDecodeError, (self.code, self.message)  # raised in a decode process, re-raised here


def open_image(
    data: bytes,
    *,
    max_pixels: int = MAX_IMAGE_PIXELS,
    draft_size: int | None = None,
    draft_margin: int = DRAFT_MARGIN,
) -> Image.Image:
    """Read only the header of ``data``: a lazily decoded image whose format and size have been checked.

    Raises :class:`ImageDecodeError` for empty, unrecognised, unsupported or oversized input, before
    any pixel is decoded (so a decompression bomb never allocates its pixels).

    ``draft_size``: the size the image will be resized to. JPEGs are then set to decode at the smallest
    DCT scale (1/2, 1/4, 1/8) that keeps both sides >= ``draft_margin * draft_size``, and the returned
    image's ``size`` is the size that will be decoded: a large speed-up for phone photos, which would
    otherwise be decoded in full only to be shrunk.
    """
    if not data:
        raise ImageDecodeError("empty_image", "the file is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageDecodeError("not_an_image", "the file is not a recognised image format") from None
    except Image.DecompressionBombError:
        # Pillow's own bomb limit (twice its MAX_IMAGE_PIXELS), far above ours: its message named its limit.
        declared = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        message = f"the image declares over {declared} pixels, more than the limit of {max_pixels}"
        raise ImageDecodeError("image_too_large", message) from None
    except MemoryError:
        raise  # the server's limit, not the client's fault: answered 503, never blamed on the image
    except Exception as err:  # Pillow's plugins raise many types on malformed headers; all mean corrupt
        raise ImageDecodeError("corrupt_image", f"the image header could not be read: {err}") from None
    if image.format not in ALLOWED_FORMATS:
        raise ImageDecodeError("unsupported_format", f"image format {image.format} is not supported")
    width, height = image.size
    if width * height > max_pixels:
        raise ImageDecodeError(
            "image_too_large", f"image is {width}x{height} pixels, more than the limit of {max_pixels}"
        )
    if image.format == "AVIF":
        image.info[FRAME_PIXELS] = _avif_frame_pixels(data, width, height, max_pixels)
    if draft_size is not None:
        draft_jpeg(image, (draft_margin * draft_size, draft_margin * draft_size))
    return image


def _avif_frame_pixels(data: bytes, width: int, height: int, max_pixels: int) -> int:
    """The pixels of the frames an AVIF really decodes (its AV1 sequence headers), checked against the
    limit: its ``ispe`` box, which gives its size, may say 64x64 over a 16384x16384 frame."""
    try:
        planes = frame_planes(data)
    except AvifStructureError as err:
        raise ImageDecodeError("corrupt_image", f"the AVIF's frames could not be read: {err}") from None
    if max(planes) > max_pixels:
        raise ImageDecodeError(
            "image_too_large",
            f"the image says it is {width}x{height} pixels, but its AV1 frames hold {max(planes)}, more "
            f"than the limit of {max_pixels}",
        )
    return planes[0]


def decoded_pixels(image: Image.Image) -> int:
    """The pixels decoding an image from :func:`open_image` makes: its frames' for an AVIF (whose size
    may lie), else its size (after JPEG draft scaling)."""
    return int(image.info.get(FRAME_PIXELS, image.width * image.height))


def draft_jpeg(image: Image.Image, size: tuple[int, int]) -> None:
    """Have a JPEG from :func:`open_image` decode at the smallest DCT scale that keeps both sides >= ``size``
    (other formats decode in full); its ``size`` becomes the size that will be decoded."""
    if image.format in ("JPEG", "MPO"):
        image.draft("RGB", size)


def load_rgb(image: Image.Image) -> Image.Image:
    """Decode an image from :func:`open_image` into RGB with its EXIF orientation applied.

    Raises :class:`ImageDecodeError` for corrupt or truncated pixel data; ``MemoryError`` passes through.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
            # In place: a copy of the decoded image would double the memory a request takes.
            ImageOps.exif_transpose(image, in_place=True)
            # Pixel-mode conversion can fail too (an exotic mode in an otherwise readable file).
            return to_rgb(image)
    except Image.DecompressionBombWarning as err:
        raise ImageDecodeError("image_too_large", str(err)) from None
    except MemoryError:
        raise
    except Exception as err:  # untrusted bytes: any decoder failure (OSError, struct.error...) is corruption
        raise ImageDecodeError("corrupt_image", f"the image could not be decoded: {err}") from None


def decode_image(
    data: bytes,
    *,
    max_pixels: int = MAX_IMAGE_PIXELS,
    draft_size: int | None = None,
    draft_margin: int = DRAFT_MARGIN,
) -> Image.Image:
    """Decode ``data`` (its first frame, for animations) into an RGB image with its EXIF orientation applied
    (see :func:`open_image`).

    Raises :class:`ImageDecodeError` for empty, corrupt, truncated, unsupported or oversized input.
    """
    return load_rgb(open_image(data, max_pixels=max_pixels, draft_size=draft_size, draft_margin=draft_margin))


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode (palette, RGBA, CMYK, 16-bit, greyscale) to 8-bit RGB.

    Transparent pixels are composited on white, as a viewer would show them. Written to hold few
    full-size copies at once (a 50-MP upload is 150 MB per RGB copy).
    """
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I;16") or image.mode == "I":
        # 16-bit greyscale: scale into 8 bits instead of clipping everything above 255 to white.
        array = np.asarray(image, dtype=np.float32)
        if image.mode.startswith("I;16") or array.max() > 255:
            array *= 255.0 / 65535.0
        image = Image.fromarray(np.clip(array, 0, 255, out=array).astype(np.uint8))
        del array
    if image.mode == "P" and "transparency" not in image.info:
        return image.convert("RGB")
    if image.mode == "LA":  # composited as greyscale: a third of the memory of doing it in RGB
        white = Image.new("L", image.size, 255)
        white.paste(image, mask=image)
        return white.convert("RGB")
    if image.mode in ("P", "PA", "RGBA"):
        if image.mode != "RGBA":
            image = image.convert("RGBA")
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image)  # the alpha band is the mask
        return white
    return image.convert("RGB")


def source_bytes(source: ImageSource) -> bytes:
    """The bytes of ``source``, a path read here (in the decode process, for a task run in one)."""
    return read_image_file(source) if isinstance(source, Path) else source


def thumbnail_jpeg(source: ImageSource, size: int, *, max_pixels: int = MAX_IMAGE_PIXELS) -> bytes:
    """A JPEG at most ``size`` pixels on its longer side, EXIF orientation applied, of the pixels only."""
    image = decode_image(source_bytes(source), max_pixels=max_pixels, draft_size=size)
    image.thumbnail((size, size), Image.Resampling.LANCZOS)
    # The source's metadata is the uploader's: Pillow writes an ``info["comment"]`` into the JPEG, and one
    # over JPEG's 64 KB segment (a GIF comment, a PNG "comment" text) failed the save with a ValueError.
    image.info.clear()
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


def pixel_digest(source: ImageSource) -> str:
    """A SHA-256 of an image's size and decoded RGB pixels (EXIF orientation applied): equal for the same
    picture in two files, whatever their bytes."""
    image = decode_image(source_bytes(source))
    digest = hashlib.sha256(f"{image.width}x{image.height}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def load_image_file(
    path: Path, *, max_pixels: int = MAX_IMAGE_PIXELS, draft_size: int | None = None
) -> Image.Image:
    """Read and decode an image file; raises :class:`ImageDecodeError` or ``OSError``."""
    return decode_image(path.read_bytes(), max_pixels=max_pixels, draft_size=draft_size)


@contextmanager
def image_header(path: Path) -> Iterator[Image.Image | None]:
    """The open header of an image file, for its format, size and EXIF (no pixel is decoded): None when
    the file is unreadable or not of a supported format. Decoding goes through :func:`open_image`."""
    try:
        image = Image.open(path)
    except Exception:  # unrecognised or unreadable: no header to read
        image = None
    if image is None:
        yield None
        return
    with image:
        yield image if image.format in ALLOWED_FORMATS else None
