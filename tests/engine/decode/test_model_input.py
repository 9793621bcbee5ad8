"""The per-request pixel budget: extreme aspect ratios resized in bounded memory, batches counted from their
headers, bad images named by position, and labels that are safe folder names."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from bench.lib.images import image_bytes, make_image
from engine.decode.images import ImageDecodeError
from engine.decode.model_input import PixelBudget, batch_tensor, open_uploads
from engine.gallery.labels import MAX_LABEL_BYTES, InvalidLabelError, check_label
from engine.model.model_card import Preprocessing
from engine.model.preprocess import resize_and_crop

CONFIG = Preprocessing(resize_size=256)


def resize_then_crop(image: Image.Image, config: Preprocessing) -> Image.Image:
    """The straightforward way (what resize_and_crop did before): resize in full, then crop the centre."""
    scale = config.resize_size / min(image.size)
    size = tuple(max(config.input_size, round(side * scale)) for side in image.size)
    resized = image.resize(size, Image.Resampling.BICUBIC)
    left, top = ((side - config.input_size) // 2 for side in size)
    return resized.crop((left, top, left + config.input_size, top + config.input_size))


@pytest.mark.parametrize("size", [(96, 80), (640, 480), (480, 640), (1000, 333), (7, 300), (224, 224)])
def test_resizing_only_the_crop_matches_resizing_in_full(size: tuple[int, int]) -> None:
    image = make_image(3, size)
    ours = np.asarray(resize_and_crop(image, CONFIG), dtype=int)
    reference = np.asarray(resize_then_crop(image, CONFIG), dtype=int)
    assert ours.shape == (224, 224, 3)
    assert np.abs(ours - reference).max() <= 2  # float rounding of the sampling grid
    assert (ours != reference).mean() < 0.01


@pytest.mark.parametrize("size", [(1, 100_000), (100_000, 1), (2, 20_000)])
def test_extreme_aspect_ratios_give_a_model_input(size: tuple[int, int]) -> None:
    (header,) = open_uploads([image_bytes(Image.new("L", size))], PixelBudget())
    assert batch_tensor([header], CONFIG).shape == (1, 3, 224, 224)


def test_a_batch_is_measured_from_its_headers_at_the_decoded_size() -> None:
    png = image_bytes(Image.new("L", (3000, 2000)))  # 6 MP
    jpeg = image_bytes(Image.new("RGB", (4000, 3000)), "JPEG")  # 12 MP, decoded at 1/4 by the draft
    budget = PixelBudget(max_batch_pixels=10_000_000, draft_size=224)
    headers = open_uploads([png, jpeg], budget)
    assert [h.size for h in headers] == [(3000, 2000), (1000, 750)]
    with pytest.raises(ImageDecodeError) as refused:
        open_uploads([png, png], budget)
    assert refused.value.code == "batch_too_large"
    assert batch_tensor(headers, CONFIG).shape == (2, 3, 224, 224)


def test_a_bad_image_is_named_by_its_position() -> None:
    good = image_bytes(make_image(1))
    with pytest.raises(ImageDecodeError, match=r"^image 2: ") as error:
        open_uploads([good, good, b"not an image"], PixelBudget())
    assert error.value.code == "not_an_image"
    with pytest.raises(ImageDecodeError, match=r"^the file is not"):  # alone, it has no position
        open_uploads([b"not an image"], PixelBudget())


@pytest.mark.parametrize(
    "label",
    [
        "",
        " ",
        " cat",
        "cat ",
        ".cat",
        "..",
        "a/b",
        "a\\b",
        "%2F",
        "\u202ecat",
        "a\u200bb",
        "tab\there",
        "x" * 101,
        "\U0001d538" * 100,
    ],
)
def test_unsafe_labels_are_refused(label: str) -> None:
    with pytest.raises(InvalidLabelError):
        check_label(label)


def test_safe_labels_are_kept_in_nfc() -> None:
    assert check_label("Audi A4 (2012) - B8, coupé's") == "Audi A4 (2012) - B8, coupé's"
    assert check_label("cafe\u0301") == "caf\u00e9"
    assert check_label("猫") == "猫"
    assert len(check_label("é" * (MAX_LABEL_BYTES // 2)).encode()) == MAX_LABEL_BYTES
