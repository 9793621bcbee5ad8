"""Untrusted image bytes to the model's input batch, within a memory budget per request.

What one request may make the server allocate is bounded before any pixel is decoded:
- each image: at most ``max_pixels`` pixels (from its header: a decompression bomb never allocates);
- the request: at most ``max_batch_pixels`` pixels decoded over all its images, summed from the headers
  (after JPEG draft scaling, which sets the size actually decoded) before the first image is decoded;
- preprocessing: images are decoded one at a time and each is cropped to the model input at once, so at
  most one full-size decoded image is held, and the resize touches only the region the crop keeps
  (:func:`engine.model.preprocess.resize_and_crop`): its output is the model input whatever the aspect ratio.

What the decoders then really take, in memory and time, is bounded by running :func:`decode_uploads` in a
decode process (``engine.decode.pool``): only the model input comes back to the server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from PIL import Image

from engine.decode.capture_time import capture_time
from engine.decode.images import (
    DRAFT_MARGIN,
    ImageDecodeError,
    ImageSource,
    decoded_pixels,
    load_rgb,
    open_image,
    source_bytes,
)
from engine.decode.pool import image_started
from engine.decode.regions import Box, Crop, crop_for
from engine.duplicates.signature import perceptual_signature
from engine.model.model_card import Preprocessing
from engine.model.preprocess import to_array
from foundation.defaults import MAX_BATCH_PIXELS, MAX_IMAGE_PIXELS
from foundation.timing import StageTimer

# Images per model run when serving. Activations take ~16 MB per image (EfficientNet-Lite0, onnxruntime
# CPU) and the arena keeps the largest run's: one run of 64 left the process 1 GB bigger, runs of 8 ~130
# MB, at the same time per image on CPU.
RUN_IMAGES = 8

T = TypeVar("T")
Stage = Callable[[str], AbstractContextManager[object]]


@dataclass(frozen=True)
class PixelBudget:
    max_pixels: int = MAX_IMAGE_PIXELS  # one image
    max_batch_pixels: int = MAX_BATCH_PIXELS  # all images of one request, as decoded
    draft_size: int | None = None  # JPEGs decode at reduced scale down to twice this (None: in full)


@dataclass(frozen=True)
class DecodedUploads:
    """A request's images as the model's input, with what else the caller needs of them."""

    tensor: np.ndarray  # NCHW, one row per image
    formats: list[str]  # each image's Pillow format (the suffix its stored file gets)
    signatures: list[bytes] | None  # perceptual signatures, when asked for
    capture_times: list[str | None] | None  # when each photo was taken (EXIF), when asked for
    ms: dict[str, float]  # "decode" and "preprocess" wall-clock milliseconds


def decode_uploads(
    images: Sequence[ImageSource],
    budget: PixelBudget,
    preprocessing: Preprocessing,
    *,
    signatures: bool = False,
    capture_times: bool = False,
    boxes: Sequence[Box | None] | None = None,
) -> DecodedUploads:
    """The decode task of one request (:func:`open_uploads`, then :func:`batch_tensor`); raises
    :class:`ImageDecodeError` naming the first bad image's position (a :class:`engine.decode.regions.BoxError`
    for a box that does not fit its image).

    ``boxes``: one per image (None: the whole image), the region of it that is the model's input.
    """
    timer = StageTimer()
    crops: list[Crop | None] = []
    with timer.stage("decode"):
        headers = open_uploads(images, budget, boxes=boxes, crops=crops)
    formats = [str(header.format) for header in headers]
    # Read before batch_tensor closes the headers.
    taken = [capture_time(header) for header in headers] if capture_times else None
    found: list[bytes] | None = [] if signatures else None
    tensor = batch_tensor(headers, preprocessing, stage=timer.stage, signatures=found, crops=crops)
    return DecodedUploads(tensor, formats, found, taken, timer.ms)


def _named(position: int, count: int, function: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``function(*args)``, the work on the ``position``-th image: its :class:`ImageDecodeError` names the
    image's position in a batch, and in a decode process its limits count from here (``image_started``)."""
    image_started(position)
    try:
        return function(*args, **kwargs)
    except ImageDecodeError as err:
        if count == 1:
            raise
        raise type(err)(err.code, f"image {position}: {err.message}") from None


def open_uploads(
    images: Sequence[ImageSource],
    budget: PixelBudget,
    *,
    boxes: Sequence[Box | None] | None = None,
    crops: list[Crop | None] | None = None,
) -> list[Image.Image]:
    """Every image's header, checked against the budget (and its box, if any); no pixel is decoded yet.

    Raises :class:`ImageDecodeError` naming the first bad image's position, or ``batch_too_large``.
    ``boxes``: one per image or None; each image's :class:`Crop` (or None) is then appended to ``crops``.
    """
    count = len(images)
    if boxes is not None and len(boxes) != count:
        raise ValueError(f"{len(boxes)} boxes for {count} images")
    headers = []
    for position, data in enumerate(images):
        box = boxes[position] if boxes is not None else None
        header, crop = _named(position, count, _open, data, budget, box)
        headers.append(header)
        if crops is not None:
            crops.append(crop)
    total = sum(decoded_pixels(header) for header in headers)
    if total > budget.max_batch_pixels:
        raise ImageDecodeError(
            "batch_too_large",
            f"the {len(headers)} images decode to {total} pixels, more than the limit of "
            f"{budget.max_batch_pixels} per request: send fewer or smaller images",
        )
    return headers


def _open(source: ImageSource, budget: PixelBudget, box: Box | None) -> tuple[Image.Image, Crop | None]:
    """One image's header and crop; a boxed JPEG's draft is set for its region, not its whole size."""
    data = source_bytes(source)
    if box is None:
        return open_image(data, max_pixels=budget.max_pixels, draft_size=budget.draft_size), None
    header = open_image(data, max_pixels=budget.max_pixels)
    return header, crop_for(header, box, budget.draft_size, DRAFT_MARGIN)


def batch_tensor(
    headers: list[Image.Image],
    preprocessing: Preprocessing,
    *,
    stage: Stage | None = None,
    signatures: list[bytes] | None = None,
    crops: Sequence[Crop | None] | None = None,
) -> np.ndarray:
    """Decode the images of :func:`open_uploads` one at a time into the model's NCHW input batch.

    ``headers`` is emptied as it goes: each image is dropped once decoded, with what its decoder holds (an
    AVIF's keeps its whole frame, 0.4 GB for a 16384x16384 one whatever its header says).

    ``stage(name)``: a context manager timing the "decode" and "preprocess" work (a ``StageTimer``'s).
    ``signatures``: when given, each image's perceptual signature is appended to it, from the same decode.
    ``crops``: one per image or None (from :func:`open_uploads`): the region cut after decoding and EXIF
    rotation, before the model's resize.
    """
    stage = stage or (lambda _: nullcontext())
    arrays, count = [], len(headers)
    headers.reverse()
    for position in range(count):
        header = headers.pop()
        with stage("decode"):
            image = _named(position, count, load_rgb, header)
            crop = crops[position] if crops else None
            if crop is not None:
                image = crop.apply(image)
        with stage("preprocess"):
            arrays.append(to_array(image, preprocessing))
            if signatures is not None:
                signatures.append(perceptual_signature(image))
        header.close()
        del image, header  # before the next image is decoded: one full-size image at a time
    with stage("preprocess"):
        return np.stack(arrays)
