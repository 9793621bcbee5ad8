"""The edited tier's aligned check: an off-centre crop of a photo is an edited copy, with its NCC in the
evidence, where its signature's views are too far; another photo of the same kind of scene is not; older
signatures (no thumbnail) and Milvus (no signatures) keep the pHash rule."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from engine.duplicates.alignment import aligned_ncc
from engine.duplicates.groups import SignatureTable, signature_distance
from engine.duplicates.signature import perceptual_signature
from engine.duplicates.signature_layout import (
    THUMBNAIL_SIDE,
    UPRIGHT_VIEWS,
    VIEW_BYTES,
    VIEWS,
    WITH_THUMBNAIL,
    thumbnail_of,
    views_of,
)
from engine.duplicates.tiers import (
    ALIGNED_NCC,
    EDITED_BITS,
    HOLDER_BITS_WEIGHT,
    Tier,
    TierSettings,
    find_tiered,
    tier_pairs,
)
from index.gallery import GalleryIndex
from tests.support.milvus_server import MILVUS_BACKENDS, milvus_target
from tests.support.vectors import entries

DIM = 16


def street_scene(seed: int) -> Image.Image:
    """A photo-like 480x360 image: a sky-to-ground gradient, blurred blocks (buildings, a car) and grain."""
    rng = np.random.default_rng(seed)
    rows = np.linspace(200, 60, 360)[:, None, None] * np.ones((360, 480, 3))
    image = Image.fromarray(rows.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(14):
        x, y = rng.integers(0, 440), rng.integers(40, 320)
        w, h = rng.integers(30, 160), rng.integers(20, 140)
        draw.rectangle((x, y, x + w, y + h), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    grain = rng.normal(0, 6, (360, 480, 3))
    blurred = np.asarray(image.filter(ImageFilter.GaussianBlur(3)), dtype=np.float64)
    return Image.fromarray(np.clip(blurred + grain, 0, 255).astype(np.uint8))


def off_centre_crop(photo: Image.Image) -> Image.Image:
    """84% of the width and 86% of the height, from the right and the top (as bench/duplicate_tiers.py's
    cropped82_offset and cropped85_reencoded)."""
    w, h = photo.size
    return photo.crop((round(w * 0.14), round(h * 0.02), w - 5, round(h * 0.88)))


def unit(rng: np.random.Generator, around: np.ndarray, spread: float) -> np.ndarray:
    vector = around + spread * rng.standard_normal(DIM)
    return vector / np.linalg.norm(vector)


def scene_index(tmp_path: Path, signatures: list[bytes]) -> tuple[GalleryIndex, list[int]]:
    """Items whose vectors are all within ~0.95 cosine of each other: to the embedding, every image here
    could be a copy of any other; only the images can tell."""
    rng = np.random.default_rng(0)
    centre = unit(rng, np.zeros(DIM), 1.0)
    vectors = np.stack([unit(rng, centre, 0.05) for _ in signatures]).astype(np.float32)
    index = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None)
    ids = index.add(vectors, entries(len(signatures)), signatures)
    index.save()
    return index, ids


def edited_partners(index: GalleryIndex, settings: TierSettings | None = None) -> dict[int, tuple[int, ...]]:
    found = find_tiered(index, Tier.EDITED, settings)
    return {
        int(i): (e.other, e.alignment) for g in found.groups for i, e in zip(g.ids, g.evidence, strict=True)
    }


def test_signatures_carry_the_thumbnail_after_their_views() -> None:
    photo = street_scene(1)
    signature = perceptual_signature(photo)
    assert len(signature) == WITH_THUMBNAIL == VIEWS * VIEW_BYTES + THUMBNAIL_SIDE**2
    thumbnail = thumbnail_of(signature)
    expected = photo.convert("L").resize((THUMBNAIL_SIDE,) * 2, Image.Resampling.LANCZOS)
    assert (
        thumbnail is not None and np.abs(thumbnail.astype(int) - np.asarray(expected, dtype=int)).max() <= 4
    )
    old = views_of(signature)
    assert len(old) == VIEWS * VIEW_BYTES and thumbnail_of(old) is None
    assert thumbnail_of(signature[: 4 * VIEW_BYTES]) is None  # four views, as stored before the turned ones


def test_the_aligned_ncc_finds_a_crop_and_not_another_scene() -> None:
    photos = [street_scene(seed) for seed in range(6)]
    thumbs = np.stack([thumbnail_of(perceptual_signature(p)) for p in photos])
    crops = np.stack([thumbnail_of(perceptual_signature(off_centre_crop(p))) for p in photos])
    copies = aligned_ncc(thumbs, crops)
    others = aligned_ncc(thumbs, np.roll(crops, 1, axis=0)).ncc
    # Every scene shares its sky-to-ground gradient: others line up a little, not as far as the cut.
    assert copies.ncc.min() > 0.9 and others.max() < ALIGNED_NCC - 0.05
    # Both ways round, and it says which image holds the other.
    swapped = aligned_ncc(crops, thumbs)
    assert np.allclose(swapped.ncc, copies.ncc)
    assert copies.first_holds.all() and not swapped.first_holds.any()
    flat = np.full((1, THUMBNAIL_SIDE, THUMBNAIL_SIDE), 128, dtype=np.uint8)
    assert aligned_ncc(flat, thumbs[:1]).ncc[0] == pytest.approx(0.0, abs=1e-3)


def test_an_off_centre_crop_is_edited_with_its_ncc_and_another_scene_is_not(tmp_path: Path) -> None:
    photo, other = street_scene(1), street_scene(2)
    signatures = [perceptual_signature(image) for image in (photo, off_centre_crop(photo), other)]
    views = np.stack([np.frombuffer(views_of(s), dtype=np.uint64) for s in signatures])
    assert signature_distance(views[:1], views[1:2])[0] > EDITED_BITS  # the pHash rule alone misses it
    index, (photo_id, crop_id, other_id) = scene_index(tmp_path, signatures)
    partners = edited_partners(index)
    assert partners[crop_id][0] == photo_id and partners[photo_id][0] == crop_id
    assert partners[crop_id][1] is not None and partners[crop_id][1] >= TierSettings().aligned_ncc
    assert other_id not in partners
    found = find_tiered(index, Tier.SIMILAR)
    assert found.aligned_checks >= 1 and "aligned NCC" in found.criteria
    # Without the check, or above the cosine the pair has, the crop is no edited copy.
    assert crop_id not in edited_partners(index, TierSettings(aligned_ncc=None))
    assert crop_id not in edited_partners(index, TierSettings(aligned_cosine=0.999))
    index.close()


def test_a_crop_that_is_nearly_a_window_of_a_second_take_does_not_join_the_take(tmp_path: Path) -> None:
    """A photo, a crop of it, and a second take of the scene (the camera moved and turned): the crop lies in
    both, the photo and the take do not line up. The crop joins the photo, which holds it best; the take
    stays out of their edited group rather than joining it through the crop."""
    scene = street_scene(2)
    w, h = scene.size
    photo = scene.crop((round(w * 0.05), round(h * 0.05), round(w * 0.8), round(h * 0.8)))
    turned = scene.rotate(2.5, resample=Image.Resampling.BICUBIC)
    take = turned.crop((round(w * 0.2), round(h * 0.15), w, h)).point(lambda v: min(255, round(v * 1.05)))
    crop = photo.crop((round(photo.width * 0.3), round(photo.height * 0.3), photo.width, photo.height))
    signatures = [perceptual_signature(image) for image in (photo, crop, take)]
    thumbs = np.stack([thumbnail_of(signature) for signature in signatures])
    with_photo, with_take, photo_take = (
        aligned_ncc(thumbs[[a]], thumbs[[b]]) for a, b in ((0, 1), (1, 2), (0, 2))
    )
    # The case the rule is for: the crop lines up with both, the photo and the take do not.
    assert with_photo.ncc[0] > with_take.ncc[0] >= ALIGNED_NCC + 0.03
    assert photo_take.ncc[0] < ALIGNED_NCC - 0.1
    assert with_photo.first_holds[0] and not with_take.first_holds[0]  # the crop is the window in both
    index, (photo_id, crop_id, take_id) = scene_index(tmp_path, signatures)
    edited, similar = find_tiered(index, Tier.EDITED), find_tiered(index, Tier.SIMILAR)
    index.close()
    assert [set(group.ids.tolist()) for group in edited.groups] == [{photo_id, crop_id}]
    # The take is what it is: the same scene, in the similar tier.
    assert [(set(g.ids.tolist()), g.tier) for g in similar.groups] == [
        ({photo_id, crop_id, take_id}, Tier.SIMILAR)
    ]


def crafted_signature(views: np.ndarray, thumbnail: np.ndarray) -> bytes:
    """A signature of the stored layout from given hash views (uint64) and a thumbnail (floats)."""
    pixels = np.clip(np.rint(thumbnail), 0, 255).astype(np.uint8)
    return views.astype(np.uint64).tobytes() + pixels.tobytes()


def flipped(views: np.ndarray, bits: int, rng: np.random.Generator) -> np.ndarray:
    """``views`` with ``bits`` random bits flipped in each view."""
    masks = [sum(1 << int(b) for b in rng.choice(64, bits, replace=False)) for _ in views]
    return views ^ np.array(masks, dtype=np.uint64)


def test_a_turned_copy_needs_a_lower_cosine_than_an_upright_look_alike(tmp_path: Path) -> None:
    """A quarter-turned copy embeds far from its photo (cosine 0.4), and its signature matches through a
    turned view: edited. Another image whose signature matches upright within the bits but which embeds at
    0.85 (a different car of the same shape) is not: an upright match needs the upright cosine."""
    rng = np.random.default_rng(1)
    views = rng.integers(0, 2**63, VIEWS, dtype=np.uint64)
    turned_copy = rng.integers(0, 2**63, VIEWS, dtype=np.uint64)
    turned_copy[0] = views[4]  # the copy looks like the photo turned by 90 degrees
    look_alike = flipped(views, EDITED_BITS - 2, rng)
    look_alike[UPRIGHT_VIEWS:] = rng.integers(
        0, 2**63, VIEWS - UPRIGHT_VIEWS, dtype=np.uint64
    )  # upright only
    signatures = [v.tobytes() for v in (views, turned_copy, look_alike)]  # no thumbnails: no aligned check
    vectors = np.zeros((3, DIM), dtype=np.float32)
    vectors[0, 0] = 1.0
    vectors[1, :2] = (0.4, np.sqrt(1 - 0.4**2))
    vectors[2, [0, 2]] = (0.85, np.sqrt(1 - 0.85**2))
    index = GalleryIndex.create(tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None)
    photo_id, copy_id, look_alike_id = index.add(vectors, entries(3), signatures)
    index.save()
    pairs, _ = tier_pairs(index, Tier.EDITED, TierSettings(edited_cosine=0.3))
    ends = zip(pairs.firsts.tolist(), pairs.seconds.tolist(), strict=True)
    turned = {frozenset(pair): bool(t) for pair, t in zip(ends, pairs.turned, strict=True)}
    found = find_tiered(index, Tier.EDITED)
    one_cosine = find_tiered(index, Tier.EDITED, TierSettings(edited_cosine=0.3))
    index.close()
    assert turned == {frozenset((photo_id, copy_id)): True, frozenset((photo_id, look_alike_id)): False}
    assert [set(g.ids.tolist()) for g in found.groups] == [{photo_id, copy_id}]
    assert [set(g.ids.tolist()) for g in one_cosine.groups] == [{photo_id, copy_id, look_alike_id}]


def test_of_two_holders_almost_as_good_the_closer_signature_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window held by two images that do not line up with each other: B holds it a little better by
    NCC (0.003), A's signature is 4 bits closer to the window's. The signature decides for A."""
    rng = np.random.default_rng(0)
    scene = street_scene(3).convert("L").resize((40, 40), Image.Resampling.LANCZOS)
    side = (THUMBNAIL_SIDE, THUMBNAIL_SIDE)
    whole = np.asarray(scene.resize(side, Image.Resampling.LANCZOS), dtype=np.float64)
    window = np.asarray(scene.crop((8, 8, 40, 40)).resize(side, Image.Resampling.LANCZOS), dtype=np.float64)
    holder_a = whole + np.random.default_rng(2).normal(0, 4, whole.shape)
    holder_b = whole.copy()  # the window's pixels exactly, something else at the top and left
    holder_b[:4, :] = rng.uniform(0, 255, (4, THUMBNAIL_SIDE))
    holder_b[:, :4] = rng.uniform(0, 255, (THUMBNAIL_SIDE, 4))
    views = rng.integers(0, 2**63, VIEWS, dtype=np.uint64)
    signatures = [
        crafted_signature(views, window),
        crafted_signature(flipped(views, EDITED_BITS + 2, rng), holder_a),
        crafted_signature(flipped(views, EDITED_BITS + 6, rng), holder_b),
    ]
    thumbs = np.stack([thumbnail_of(signature) for signature in signatures])
    by_a, by_b = aligned_ncc(thumbs[[1]], thumbs[:1]).ncc[0], aligned_ncc(thumbs[[2]], thumbs[:1]).ncc[0]
    assert by_a >= ALIGNED_NCC and 0 < by_b - by_a < 4 * HOLDER_BITS_WEIGHT
    assert aligned_ncc(thumbs[[1]], thumbs[[2]]).ncc[0] < ALIGNED_NCC  # the holders do not line up
    index, (window_id, a_id, b_id) = scene_index(tmp_path, signatures)
    by_signature = find_tiered(index, Tier.EDITED)
    monkeypatch.setattr("engine.duplicates.tiers.HOLDER_BITS_WEIGHT", 0.0)
    by_ncc_alone = find_tiered(index, Tier.EDITED)
    index.close()
    assert [set(g.ids.tolist()) for g in by_signature.groups] == [{window_id, a_id}]
    assert [set(g.ids.tolist()) for g in by_ncc_alone.groups] == [{window_id, b_id}]


def test_a_group_is_labelled_with_the_strictest_tier_that_joins_it(tmp_path: Path) -> None:
    """A photo, an off-centre crop and a quarter turn of it: each copy is an edited copy of the photo, while
    the crop and the turn are only "similar" to each other. The group is an edited group, at every tier."""
    photo = street_scene(1)
    images = [photo, off_centre_crop(photo), photo.rotate(90, expand=True)]
    index, ids = scene_index(tmp_path, [perceptual_signature(image) for image in images])
    similar, edited = find_tiered(index, Tier.SIMILAR), find_tiered(index, Tier.EDITED)
    pairs, _ = tier_pairs(index, Tier.SIMILAR, TierSettings())
    index.close()
    tier_of = {
        frozenset((int(a), int(b))): Tier(int(t))
        for a, b, t in zip(pairs.firsts, pairs.seconds, pairs.tiers, strict=True)
    }
    assert tier_of[frozenset((ids[1], ids[2]))] == Tier.SIMILAR  # the crop and the turn
    for found in (similar, edited):
        assert [(set(g.ids.tolist()), g.tier) for g in found.groups] == [(set(ids), Tier.EDITED)]


def test_the_pairs_checked_between_two_signature_groups(tmp_path: Path) -> None:
    """A photo with three copies (one group by signature), a crop of it and another scene: the crop and
    the other scene each meet four members of the group; all four are checked by default, the two of
    highest cosine with ``aligned_tries=2``."""
    photo, other = street_scene(6), street_scene(7)
    buffer = io.BytesIO()
    photo.save(buffer, format="JPEG", quality=60)
    copies = [
        Image.open(buffer).convert("RGB"),
        photo.resize((240, 180)),
        photo.point(lambda v: min(255, v + 12)),
    ]
    images = [photo, *copies, off_centre_crop(photo), other]
    index, ids = scene_index(tmp_path, [perceptual_signature(image) for image in images])
    tries = 2
    found = find_tiered(index, Tier.EDITED, TierSettings(aligned_tries=tries))
    every = find_tiered(index, Tier.EDITED)  # the default: every pair
    index.close()
    assert found.aligned_checks == tries * 2 + 1  # crop-group, other-group, crop-other
    assert every.aligned_checks == 4 * 2 + 1
    for result in (found, every):
        assert [set(g.ids.tolist()) for g in result.groups] == [set(ids[:5])]


def test_signatures_without_a_thumbnail_keep_the_phash_rule(tmp_path: Path) -> None:
    """Older signatures (seven or four views, no thumbnail): a re-encoded copy is still edited, the crop
    is not (no thumbnail to align), and a table of mixed lengths compares the views all items have."""
    photo = street_scene(3)
    buffer = io.BytesIO()
    photo.save(buffer, format="JPEG", quality=50)
    reencoded = Image.open(buffer).convert("RGB")
    full = [perceptual_signature(image) for image in (photo, off_centre_crop(photo), reencoded)]
    signatures = [views_of(full[0]), views_of(full[1]), full[2][: 4 * VIEW_BYTES]]
    index, (photo_id, crop_id, copy_id) = scene_index(tmp_path, signatures)
    table = SignatureTable(index.signatures())
    assert table.rows.shape == (3, 4) and not table.has_thumbnail.any()
    found = find_tiered(index, Tier.EDITED)
    partners = {int(i): e for g in found.groups for i, e in zip(g.ids, g.evidence, strict=True)}
    assert partners[copy_id].other == photo_id and partners[copy_id].alignment is None
    assert crop_id not in partners and found.aligned_checks == 0
    index.close()


def test_a_mixed_table_aligns_only_pairs_that_both_carry_a_thumbnail(tmp_path: Path) -> None:
    photo = street_scene(4)
    crop = off_centre_crop(photo)
    signatures = [
        perceptual_signature(photo),
        views_of(perceptual_signature(crop)),
        perceptual_signature(crop),
    ]
    index, (photo_id, old_crop_id, crop_id) = scene_index(tmp_path, signatures)
    table = SignatureTable(index.signatures())
    with_thumbnail, thumbnails = table.thumbnails_of(np.array([crop_id, old_crop_id, photo_id, 999]))
    assert with_thumbnail.tolist() == [True, False, True, False] and len(thumbnails) == 2
    assert np.array_equal(thumbnails[0], thumbnail_of(signatures[2]))
    partners = edited_partners(index)
    assert partners[crop_id][1] is not None
    # The old crop is within 0 bits of the new crop's views: an edited pair by signature, no NCC needed.
    assert partners[old_crop_id] == (crop_id, None)
    index.close()


@pytest.mark.parametrize("engine", MILVUS_BACKENDS[:1])
def test_milvus_without_signatures_is_judged_as_before(
    engine: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Milvus keeps no signatures: no thumbnails, no aligned check; its edited pairs are by cosine alone."""
    rng = np.random.default_rng(5)
    base = np.stack([unit(rng, np.zeros(DIM), 1.0) for _ in range(20)])
    vectors = np.concatenate([base, [unit(rng, base[0], 0.01)]]).astype(np.float32)
    target = milvus_target(engine, request, tmp_path / "index")
    index = GalleryIndex.create(
        tmp_path / "index", dim=DIM, model_fingerprint="m", gallery_root=None, **target
    )
    signatures = [perceptual_signature(street_scene(seed)) for seed in range(len(vectors))]
    ids = index.add(vectors, entries(len(vectors)), signatures)
    index.save()
    with_check, without = (
        find_tiered(index, Tier.EDITED),
        find_tiered(index, Tier.EDITED, TierSettings(aligned_ncc=None)),
    )
    index.close()
    assert with_check.unsigned == len(vectors) and with_check.aligned_checks == 0
    groups = [g.ids.tolist() for g in with_check.groups]
    assert groups == [g.ids.tolist() for g in without.groups] == [sorted([ids[0], ids[-1]])]
    assert all(e.alignment is None and e.bits is None for g in with_check.groups for e in g.evidence)
