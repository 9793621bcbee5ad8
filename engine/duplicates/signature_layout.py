"""The layout of a stored perceptual signature (opaque bytes the engine computes from an image, see
``engine.duplicates.signature``), the one thing ``index`` knows about them:

- ``VIEWS`` hashes of ``VIEW_BITS`` bits each (8 bytes, native uint64 order), the image's own view first.
  Signatures stored before views were added hold fewer of them (4): they are the first views of today's.
- Then, in signatures stored since aligned thumbnails were added, a ``THUMBNAIL_SIDE`` x
  ``THUMBNAIL_SIDE`` greyscale thumbnail of the whole image (uint8, rows top to bottom, the image squeezed
  to a square) for the aligned check of ``engine.duplicates.alignment``. Older signatures have none.
"""

from __future__ import annotations

import numpy as np

VIEW_BITS = 64  # one 64-bit hash per view
VIEW_BYTES = VIEW_BITS // 8
VIEWS = 7
# The first views are upright (the image, its mirror, its centre crop, the crop's mirror); the rest are
# the image turned by 90, 180 and 270 degrees (engine.duplicates.signature).
UPRIGHT_VIEWS = 4
THUMBNAIL_SIDE = 32
THUMBNAIL_BYTES = THUMBNAIL_SIDE * THUMBNAIL_SIDE
WITH_THUMBNAIL = VIEWS * VIEW_BYTES + THUMBNAIL_BYTES  # the length of a signature that has a thumbnail


def views_of(signature: bytes) -> bytes:
    """The hash views of ``signature`` (all of it where it has no thumbnail)."""
    return signature[: VIEWS * VIEW_BYTES]


def thumbnail_of(signature: bytes) -> np.ndarray | None:
    """The ``THUMBNAIL_SIDE``-square uint8 thumbnail ``signature`` carries, or None (an older one)."""
    if len(signature) != WITH_THUMBNAIL:
        return None
    return np.frombuffer(signature, dtype=np.uint8, offset=VIEWS * VIEW_BYTES).reshape(
        THUMBNAIL_SIDE, THUMBNAIL_SIDE
    )
