"""Files whose header lies about their size (issue 43, class 5): the pixel limit is checked against the
frames the decoder decodes, not the size the container declares. Files made here (bench/lib)."""

from __future__ import annotations

import random
import time

import pytest
from PIL import Image

from bench.lib.hostile_images import (
    avif_lying_ispe,
    avif_rgba_lying_ispe,
    avif_without_sequence_header,
    encode,
    heic_lying_ispe,
    with_ispe,
)
from engine.decode.avif_frames import AvifStructureError, frame_planes
from engine.decode.images import ImageDecodeError, decode_image, open_image
from engine.decode.model_input import PixelBudget, open_uploads


@pytest.fixture(scope="module")
def avif_8192_says_64() -> bytes:
    return avif_lying_ispe()


def test_an_avif_whose_ispe_says_64x64_over_an_8192_frame_is_refused_from_its_header(
    avif_8192_says_64: bytes,
) -> None:
    """Before: decoded (the frame, 0.2-0.6 GB in the decode process) and answered 200; Pillow reports the
    ispe's 64x64 even after decoding. Now refused before any pixel is decoded, naming the real count."""
    started = time.process_time()
    with pytest.raises(ImageDecodeError, match="says it is 64x64 pixels, but its AV1 frames hold 67108864"):
        open_image(avif_8192_says_64)
    assert time.process_time() - started < 1  # the header, not the frame
    with pytest.raises(ImageDecodeError) as refused:
        decode_image(avif_8192_says_64)
    assert refused.value.code == "image_too_large"


def test_lying_avifs_under_the_limit_count_their_frames_in_the_request_budget() -> None:
    """Two 64x64-declared AVIFs over 2048x2048 frames (4.2 MP each) in a request limited to 5 MP: before,
    their 8,192 declared pixels passed the request's budget."""
    lie = avif_lying_ispe(side=2048)
    with pytest.raises(ImageDecodeError, match="decode to 8388608 pixels") as refused:
        open_uploads([lie, lie], PixelBudget(max_batch_pixels=5_000_000))
    assert refused.value.code == "batch_too_large"


def test_an_avif_whose_alpha_plane_lies_is_checked_plane_by_plane() -> None:
    """The alpha plane is a second AV1 item (``auxl``), decoded too: each plane is held to the limit."""
    lie = avif_rgba_lying_ispe(side=2048)
    assert frame_planes(lie) == [2048 * 2048, 2048 * 2048]
    with pytest.raises(ImageDecodeError, match="AV1 frames hold 4194304, more than the limit of 4000000"):
        open_image(lie, max_pixels=4_000_000)


def test_an_avif_whose_frame_size_cannot_be_read_is_refused_as_corrupt() -> None:
    with pytest.raises(ImageDecodeError, match="no AV1 sequence header") as refused:
        open_image(avif_without_sequence_header())
    assert refused.value.code == "corrupt_image"


@pytest.mark.parametrize(("mode", "size"), [("RGB", (640, 427)), ("RGBA", (333, 500)), ("L", (1, 4000))])
def test_honest_avifs_read_their_own_size_from_their_frames(mode: str, size: tuple[int, int]) -> None:
    data = encode(Image.new(mode, size), "AVIF", speed=10, quality=10)
    planes = frame_planes(data)
    assert planes == [size[0] * size[1]] * len(planes) and len(planes) == (2 if mode == "RGBA" else 1)
    assert decode_image(data).size == size


def test_an_avif_that_declares_more_than_its_frame_is_refused_by_the_declared_size() -> None:
    honest = encode(Image.new("RGB", (64, 64)), "AVIF", speed=10, quality=10)
    with pytest.raises(ImageDecodeError, match="is 8000x8000 pixels") as refused:
        open_image(with_ispe(honest, 8000))
    assert refused.value.code == "image_too_large"


def test_a_heic_whose_ispe_says_64x64_over_an_8192_frame_is_refused_by_libheif_before_decoding() -> None:
    """libheif's own limit: it compares the HEVC frame with the ispe box and refuses (in milliseconds, no
    frame allocated), which the decode reports as corrupt."""
    lie = heic_lying_ispe()
    started = time.process_time()
    with pytest.raises(ImageDecodeError, match="Security limit exceeded") as refused:
        decode_image(lie)
    assert time.process_time() - started < 2
    assert refused.value.code == "corrupt_image"


def test_mutated_avifs_are_read_or_refused_never_crash_the_reader() -> None:
    """Hostile: 3,000 AVIFs with bytes changed, cut out or inserted (seeded), read by the box and sequence
    header reader: each gives its planes or AvifStructureError (400 corrupt_image), never another
    exception (a 500), and none takes long (every loop is bounded by the bytes it reads)."""
    rng = random.Random(0)
    seeds = [
        encode(Image.new("RGBA", (300, 200)), "AVIF", speed=10, quality=10),
        encode(Image.new("RGB", (64, 64)), "AVIF", speed=10, quality=10),
    ]
    started, read = time.process_time(), 0
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            at, kind = rng.randrange(len(data)), rng.random()
            if kind < 0.6:
                data[at] = rng.randrange(256)
            elif kind < 0.8:
                del data[at : at + rng.randint(1, 16)]
            else:
                data[at:at] = rng.randbytes(rng.randint(1, 8))
        try:
            frame_planes(bytes(data))
            read += 1
        except AvifStructureError:
            pass
    assert 0 < read < 3000
    assert time.process_time() - started < 30
