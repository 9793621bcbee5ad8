"""Perceptual signatures: what tells two copies of one photo from two photos of the same thing.

The embedding is trained for category similarity: two photos of one car model embed as close as a photo
and its half-size copy (bench/results/duplicates.md). A perceptual hash (imagehash's pHash: the signs of
the lowest 8x8 DCT frequencies of a 32x32 greyscale thumbnail) is the other way round: re-encoding,
resizing and brightness barely move it, while different photos land ~32 bits of 64 apart. A signature is
the pHash of seven views: the image itself, its mirror, its centre 90% crop and that crop's mirror, and
the image turned by 90, 180 and 270 degrees, so that a mirrored copy, a copy cropped by about 10% (85-95%,
centred) and a copy turned by a quarter turn (an editor's rotation, a lost EXIF orientation) match one
view of the other image. Other crops (off-centre, or tighter) move every view by more than near-duplicate
search allows (an off-centre 88% crop measured 20 bits), so the views are followed by pHash's own 32x32
greyscale thumbnail of the image, for ``engine.duplicates.alignment``'s check that one image is a window of
the other. The layout (``engine.duplicates.signature_layout``): signatures of four views (stored before the
turned views were added) are the first four views of today's, and those of seven views without a thumbnail
(stored before thumbnails were added) fall back to the views alone. ``engine.duplicates.groups`` compares the
views as bit strings; this module is the only place that knows signatures come from images.

Computed where the image is decoded anyway (the build's decode workers, uploads), so it costs no decode.
"""

from __future__ import annotations

import imagehash
import numpy as np
from PIL import Image, ImageOps

from engine.duplicates.signature_layout import THUMBNAIL_SIDE

HASH_SIZE = 8  # 8x8 = 64-bit pHash, imagehash's default
# pHash looks at a 32x32 thumbnail (HASH_SIZE x imagehash's highfreq_factor 4): each view is reduced to it
# once and its mirror taken from the thumbnail, instead of scaling the full image for every view. The
# signature also stores the image's own thumbnail, for the aligned check (imagehash would resize a
# thumbnail of another side to 32 px itself).
THUMBNAIL_SIZE = THUMBNAIL_SIDE
CROP = 0.9  # the crop view keeps this share of each side, centred
TURNS = (Image.Transpose.ROTATE_90, Image.Transpose.ROTATE_180, Image.Transpose.ROTATE_270)


def perceptual_signature(image: Image.Image) -> bytes:
    """The pHashes of ``image``, its mirror, its centre crop, the crop's mirror and ``image`` turned by
    90, 180 and 270 degrees, 8 bytes each (``engine.duplicates.groups``'s signature views: the image itself
    first), then its greyscale thumbnail (``engine.duplicates.signature_layout``)."""
    grey = image.convert("L")
    margin_x, margin_y = grey.width * (1 - CROP) / 2, grey.height * (1 - CROP) / 2
    crop = (margin_x, margin_y, grey.width - margin_x, grey.height - margin_y)
    size = (THUMBNAIL_SIZE, THUMBNAIL_SIZE)
    # reducing_gap: a box reduction first, then Lanczos: 3x (224 px) to 9x (a drafted 12-MP JPEG) faster
    # than Lanczos all the way (bench/duplicates.py measures the signatures as computed here).
    whole, cropped = (
        grey.resize(size, Image.Resampling.LANCZOS, box=box, reducing_gap=2.0) for box in (None, crop)
    )
    # Turning the square thumbnail equals the thumbnail of the turned image: the resize filters each axis
    # by its own scale, whichever way up the image is.
    turned = (whole.transpose(turn) for turn in TURNS)
    views = (whole, ImageOps.mirror(whole), cropped, ImageOps.mirror(cropped), *turned)
    hashes = b"".join(np.packbits(imagehash.phash(view, HASH_SIZE).hash).tobytes() for view in views)
    return hashes + np.asarray(whole, dtype=np.uint8).tobytes()
