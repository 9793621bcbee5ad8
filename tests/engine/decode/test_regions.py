"""Query boxes in the engine: a large boxed JPEG decodes at the draft scale its region allows, and the
region it gives the model is the hand crop of the full decode."""

from __future__ import annotations

import numpy as np
import pytest

from bench.lib.images import image_bytes, make_image
from engine.decode.images import decode_image
from engine.decode.model_input import PixelBudget, batch_tensor, open_uploads
from engine.decode.regions import Box, Crop
from engine.model.model_card import Preprocessing
from engine.model.preprocess import to_tensor

CONFIG = Preprocessing()


@pytest.mark.parametrize(
    ("box", "size"),
    [
        (Box(900, 400, 2100, 1600), (1500, 1000)),  # 1200-px region: at 1/2 it keeps 600 >= 2 x 224
        (Box(100, 100, 400, 500), (3000, 2000)),  # 300-px region: decoded in full
    ],
)
def test_a_boxed_jpeg_is_drafted_for_its_region_and_gives_the_hand_crop(
    box: Box, size: tuple[int, int]
) -> None:
    data = image_bytes(make_image(3, (3000, 2000)), "JPEG", quality=92)
    budget = PixelBudget(draft_size=CONFIG.resize_size)
    crops: list[Crop | None] = []
    (header,) = open_uploads([data], budget, boxes=[box], crops=crops)
    assert header.size == size
    (whole,) = open_uploads([data], budget)
    assert whole.size == (750, 500)  # without a box, the whole image is drafted to 1/4
    boxed = batch_tensor([header], CONFIG, crops=crops)
    full = decode_image(data).crop((round(box.x0), round(box.y0), round(box.x1), round(box.y1)))
    by_hand = to_tensor([full], CONFIG)
    assert boxed.shape == by_hand.shape == (1, 3, 224, 224)
    # Normalised units (std ~0.22 of a pixel level range): the DCT-scaled decode differs by rounding only.
    assert float(np.abs(boxed - by_hand).mean()) < 0.03


def test_fractions_and_pixels_name_the_same_region() -> None:
    assert Box.parse("0.25,0.5,0.75,1").pixels(800, 600) == (200, 300, 600, 600)
    assert Box.parse("200,300,600,600").pixels(800, 600) == (200, 300, 600, 600)
    assert not Box.parse("0,0,1,1.5").fractional  # pixels: 1.5 px high, then too small


def test_a_side_as_long_as_a_small_images_is_never_too_small() -> None:
    from engine.decode.regions import BoxError
    from foundation.defaults import MIN_BOX_SIDE

    assert Box.parse("0,0,1,1").pixels(8, 40) == (0, 0, 8, 40)  # the whole of a small image
    assert Box.parse("0,0,8,20").pixels(8, 40) == (0, 0, 8, 20)  # a full-width strip of it
    with pytest.raises(BoxError, match="less than the minimum"):
        Box.parse("0,0,8,10").pixels(8, 40)  # shorter than both the minimum and the image
    with pytest.raises(BoxError, match="less than the minimum"):
        Box.parse(f"0,0,{MIN_BOX_SIDE - 1},{MIN_BOX_SIDE}").pixels(100, 100)
