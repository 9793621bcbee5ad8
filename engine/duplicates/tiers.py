"""Duplicate tiers: every pair of images that belong together is classified as the strictest tier it meets.

- **exact**: the same bytes (same content hash) or the same decoded pixels (a digest the engine computes
  from the files, asked for only for pairs whose perceptual signatures are identical). An index holds one
  item per content, so files with an item's bytes are not items: :func:`with_byte_copies` adds them (the
  engine finds them in the gallery folder) to their item's group, or to a group of their own;
- **edited**: one photo re-encoded, resized, lightly cropped, mirrored, turned, colour-adjusted or
  watermarked: perceptual signatures within ``edited_bits`` and cosine >= ``edited_cosine``, or
  ``turned_cosine`` where they match through a turned view (``engine.duplicates.groups``'s pairs: the
  signature tells a copy from another photo of the same thing, the embedding rules out different images whose
  thumbnails happen to agree); or, for a crop off-centre or tighter than the
  signature's views cover, cosine >= ``aligned_cosine`` and one image's thumbnail a window of the other's:
  ``engine.duplicates.alignment``'s NCC >= ``aligned_ncc``. That check is costly, so it runs only on pairs of
  the kNN search (see below) whose signatures carry thumbnails and which no signature pair has already put
  in one group (checking them would change no group). A window joins only the image that holds it best:
  a crop of a photo is nearly a window of a second take of the scene too, and must not bring the take
  into the photo's group;
- **similar**: the same scene, as in a burst or a second take: cosine >= ``similar_cosine`` among each
  item's nearest neighbours, and signatures within ``similar_bits`` (looser than an edit).

Asking for a tier gives the groups that pairs of that tier *or stricter* join (``--tier edited`` includes
exact copies); each group is labelled with the strictest tier whose pairs alone join all its members, and
each member carries the evidence of its strongest pair (the other item, the signature distance, the
cosine, the shared digest, the aligned NCC where it was checked).
Items without a signature (indexed before signatures were stored; Milvus) can be neither exact nor
edited by pixels: an edited pair with one of them needs ``engine.duplicates.groups.EMBEDDING_ONLY_THRESHOLD``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

from engine.duplicates.alignment import aligned_ncc
from engine.duplicates.groups import (
    DEFAULT_NEIGHBOURS,
    EMBEDDING_ONLY_THRESHOLD,
    DuplicateGroup,
    SignatureTable,
    candidate_pairs,
    check_max_distance,
    check_threshold,
    components,
    group_pairs,
    pair_cosines,
    signature_match,
    signature_pairs,
)
from foundation.defaults import SIMILAR_COSINE
from foundation.errors import InvalidInputError

if TYPE_CHECKING:
    from index.gallery import GalleryIndex
    from index.protocol import Item


class Tier(IntEnum):
    """Strictest first: a lower value is a closer copy."""

    EXACT = 0
    EDITED = 1
    SIMILAR = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> Tier:
        try:
            return cls[name.upper()]
        except KeyError:
            raise InvalidInputError(f"unknown tier {name!r}: choose exact, edited or similar") from None


TIER_NAMES = tuple(tier.label for tier in Tier)

# The edited tier's signature rule. A copy turned by a quarter embeds at cosine ~0.3-0.6 to its photo (the
# embedding is not rotation-invariant), so a pair whose signatures match through a turned view needs only
# TURNED_COSINE; through an upright view (the image, its mirror, its centre crop) it needs EDITED_COSINE:
# with 0.3 for both, different cars of a similar shape whose signatures matched within 6-8 bits at cosine
# 0.65-0.89 made 2% of the photos of bench/duplicate_tiers.py's half A edited copies of another. The
# upright cosine was chosen on half A among 0.8, 0.85, 0.9 and 0.92 as the one meeting issue 23's goals
# there (<= 1% of the photos in a false edited group, every kind of copy >= 0.95 in its photo's group);
# both halves at these defaults: bench/results/duplicate_tiers.md. The bench's own choice on A maximises
# pair recall with one cosine for every view, and so loses quarter turns.
EDITED_COSINE = 0.9
TURNED_COSINE = 0.3
EDITED_BITS = 8
# The aligned check of off-centre crops (engine.duplicates.alignment). 0.8 is the lowest cosine tried: below
# it the pairs to check grow fast (bench/results/crop_alignment.md). Checking every pair between two signature
# groups lets each window meet the photo itself, not only the copies of it that embed closest: a window
# joins only its best holder (_best_holder), so the holder must be among the pairs checked.
ALIGNED_COSINE = 0.8
ALIGNED_NCC = 0.86
ALIGNED_TRIES: int | None = None
# Where two images hold a window almost equally well (a copy turned 2 degrees and cropped, held by its
# photo and by a second take turned by the camera), the signature's distance decides: 1 bit counts as
# 0.002 of NCC. On half B of the bench it lifted the worst kind of copy from 0.928 to 0.964, and edited
# pair precision rose by 0.002 on both halves (0.005 did the same; tried on both halves, not chosen on A).
HOLDER_BITS_WEIGHT = 0.002
# The similar tier's cosine is foundation.defaults.SIMILAR_COSINE (the keeper rule reads it too). No signature
# limit: a take's signature lands about as far from its photo's as another photo's (14-22 bits; a limit of
# 16 bits lost half the takes for no better min(P, R)).
SIMILAR_BITS = 64

# Reads the pixel digests of items (engine.pixel_digest): id -> digest, absent where a file cannot be read.
PixelDigests = Callable[[Sequence["Item"]], dict[int, str]]


@dataclass(frozen=True)
class TierSettings:
    edited_cosine: float = EDITED_COSINE
    turned_cosine: float = TURNED_COSINE
    edited_bits: int = EDITED_BITS
    similar_cosine: float = SIMILAR_COSINE
    similar_bits: int = SIMILAR_BITS
    neighbours: int = DEFAULT_NEIGHBOURS
    aligned_cosine: float = ALIGNED_COSINE
    aligned_ncc: float | None = ALIGNED_NCC  # None: no aligned check (the signature's views alone)
    aligned_tries: int | None = ALIGNED_TRIES  # None: every pair between two signature groups

    def check(self) -> None:
        check_threshold(self.edited_cosine)
        check_threshold(self.turned_cosine)
        check_threshold(self.similar_cosine)
        check_threshold(self.aligned_cosine)
        if self.aligned_ncc is not None and not -1.0 <= self.aligned_ncc <= 1.0:
            raise InvalidInputError(f"aligned_ncc must be an NCC in [-1, 1], got {self.aligned_ncc}")
        if self.aligned_tries is not None and self.aligned_tries < 1:
            raise InvalidInputError(f"aligned_tries must be at least 1, got {self.aligned_tries}")
        check_max_distance(self.edited_bits)
        if not 0 <= self.similar_bits <= 64:
            raise InvalidInputError(f"similar_bits must be in [0, 64], got {self.similar_bits}")

    def criteria(self, tier: Tier) -> str:
        rules = ["exact: same bytes or same decoded pixels"]
        if tier >= Tier.EDITED:
            bits, cosine, turned = self.edited_bits, self.edited_cosine, self.turned_cosine
            edited = f"edited: signatures within {bits} bits and cosine >= {cosine} (>= {turned} turned)"
            if self.aligned_ncc is not None:
                edited += (
                    f", or cosine >= {self.aligned_cosine} and one thumbnail a window of the other "
                    f"(aligned NCC >= {self.aligned_ncc})"
                )
            rules.append(edited)
        if tier >= Tier.SIMILAR:
            within = "" if self.similar_bits >= 64 else f" and signatures within {self.similar_bits} bits"
            rules.append(f"similar: cosine >= {self.similar_cosine}{within}")
        return "; ".join(rules)


@dataclass(frozen=True)
class Evidence:
    """Why a member is in its group: its strongest pair."""

    other: int  # the item it pairs with (itself where its strongest pair is a byte copy of it)
    tier: Tier
    bits: int | None  # perceptual-signature distance (None: either item has no signature)
    cosine: float
    digest: str | None  # the content hash or pixel digest both share (exact pairs only)
    alignment: float | None = None  # the aligned NCC of the pair's thumbnails (None: not checked)


@dataclass(frozen=True)
class ByteCopy:
    """A gallery file with the bytes of an indexed item, which the index holds once (under ``of``)."""

    path: str  # relative to the gallery folder
    of: int  # the item's id
    content_hash: str

    @property
    def evidence(self) -> Evidence:
        return Evidence(self.of, Tier.EXACT, 0, 1.0, f"sha256:{self.content_hash}")


@dataclass(frozen=True)
class TieredGroup:
    tier: Tier  # the strictest tier whose pairs alone join all its members
    ids: np.ndarray  # ascending
    evidence: list[Evidence]  # one per member, in ``ids`` order
    copies: tuple[ByteCopy, ...] = ()  # files with the bytes of a member, which are not items

    @property
    def size(self) -> int:
        return len(self.ids) + len(self.copies)


@dataclass(frozen=True)
class TieredDuplicates:
    tier: Tier  # the loosest tier asked for
    groups: list[TieredGroup]  # largest first
    settings: TierSettings
    unsigned: int
    items: int
    aligned_checks: int  # pairs the aligned check looked at

    @property
    def criteria(self) -> str:
        return self.settings.criteria(self.tier)


@dataclass(frozen=True)
class Pairs:
    """Candidate pairs (first id < second id) with their evidence and tier."""

    firsts: np.ndarray
    seconds: np.ndarray
    bits: np.ndarray  # -1 where either item has no signature
    turned: np.ndarray  # bool: the signatures match through a turned view (see classify)
    cosines: np.ndarray
    tiers: np.ndarray
    digests: list[str | None]
    alignments: np.ndarray  # the aligned NCC, NaN where not checked
    aligned_checks: int  # pairs the aligned check looked at (of every tier)


def _pair_bits(
    signatures: SignatureTable, firsts: np.ndarray, seconds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each pair's signature distance (-1 where either item has none), and whether it is reached only
    through a turned view (``engine.duplicates.groups.signature_match``)."""
    first_signed, first_rows = signatures.lookup(firsts)
    second_signed, second_rows = signatures.lookup(seconds)
    both = first_signed & second_signed
    first_rows, second_rows = first_rows[both[first_signed]], second_rows[both[second_signed]]
    bits = np.full(len(firsts), -1, dtype=np.int64)
    turned = np.zeros(len(firsts), dtype=bool)
    bits[both], turned[both] = signature_match(first_rows, second_rows)
    return bits, turned


def _distinct(firsts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Positions of the first occurrence of each (first, second) pair."""
    keys = firsts.astype(np.int64) * (1 << 32) + seconds.astype(np.int64)  # ids are far below 2**31 here
    return np.sort(np.unique(keys, return_index=True)[1])


def classify(bits: np.ndarray, turned: np.ndarray, cosines: np.ndarray, settings: TierSettings) -> np.ndarray:
    """Each pair's tier by its signature distance (-1: unsigned), whether the signatures match through a
    turned view, and its cosine: EDITED or SIMILAR, or ``len(Tier)`` for a pair of no tier (exact copies
    are told by their bytes or pixels, not here)."""
    signed = bits >= 0
    cosine_needed = np.where(turned, settings.turned_cosine, settings.edited_cosine)
    edited = np.where(
        signed,
        (bits <= settings.edited_bits) & (cosines >= cosine_needed),
        cosines >= EMBEDDING_ONLY_THRESHOLD,
    )
    similar = (cosines >= settings.similar_cosine) & (~signed | (bits <= settings.similar_bits))
    return np.where(edited, int(Tier.EDITED), np.where(similar, int(Tier.SIMILAR), len(Tier)))


def _align(
    signatures: SignatureTable,
    firsts: np.ndarray,
    seconds: np.ndarray,
    bits: np.ndarray,
    cosines: np.ndarray,
    tiers: np.ndarray,
    alignments: np.ndarray,
    settings: TierSettings,
) -> int:
    """The aligned check (in place): pairs of no edited tier yet with cosine >= ``aligned_cosine``, both
    thumbnails, and not already in one group by the signature's edited pairs get their NCC in
    ``alignments``, and EDITED in ``tiers`` where it is >= ``aligned_ncc`` and the window's best holder
    (:func:`_best_holder`). Returns how many it checked.

    Of the pairs between the same two signature groups only the ``aligned_tries`` of highest cosine are
    checked: one success joins the groups, and a crop of a photo with many copies otherwise meets every
    copy (half B of bench/duplicate_tiers.py: 3.8 pairs per image without that limit)."""
    both = signatures.with_thumbnail(firsts) & signatures.with_thumbnail(seconds)
    wanted = (tiers > int(Tier.EDITED)) & (cosines >= settings.aligned_cosine) & both
    if not wanted.any():
        return 0
    edited = tiers == int(Tier.EDITED)
    ids = np.unique(np.concatenate([firsts, seconds]))
    component = components(
        len(ids), np.searchsorted(ids, firsts[edited]), np.searchsorted(ids, seconds[edited])
    )
    first_group = component[np.searchsorted(ids, firsts)]
    second_group = component[np.searchsorted(ids, seconds)]
    candidates = np.flatnonzero(wanted & (first_group != second_group))
    low = np.minimum(first_group, second_group)[candidates]
    high = np.maximum(first_group, second_group)[candidates]
    order = np.lexsort((-cosines[candidates], high, low))  # by pair of groups, the highest cosine first
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = (low[order][1:] != low[order][:-1]) | (high[order][1:] != high[order][:-1])
    rank = np.arange(len(order)) - np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))
    tries = len(order) if settings.aligned_tries is None else settings.aligned_tries
    checked = np.sort(candidates[order[rank < tries]])
    found = aligned_ncc(
        signatures.thumbnails_of(firsts[checked])[1], signatures.thumbnails_of(seconds[checked])[1]
    )
    alignments[checked] = found.ncc
    aligned = found.ncc >= settings.aligned_ncc
    windows = np.where(found.first_holds, second_group[checked], first_group[checked])[aligned]
    kept = _best_holder(windows, (found.ncc - HOLDER_BITS_WEIGHT * bits[checked])[aligned])
    tiers[checked[aligned][kept]] = int(Tier.EDITED)
    return len(checked)


def _best_holder(windows: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Which aligned pairs join their groups: of the pairs in which a signature group is the window, the
    one of highest score (the NCC, less ``HOLDER_BITS_WEIGHT`` per bit of signature distance). Every copy
    in an edited group is then the photo held by the group's widest image (or a window of it, or of a
    window of it), never a window of two images that overlap only partly: an off-centre crop of a photo
    is also nearly a window of a second take of the same scene (the camera moved a little), and would
    otherwise join the take to the photo's edited group."""
    order = np.lexsort((-scores, windows))
    first = np.ones(len(order), dtype=bool)
    first[1:] = windows[order][1:] != windows[order][:-1]
    kept = np.zeros(len(windows), dtype=bool)
    kept[order[first]] = True
    return kept


def tier_pairs(
    index: GalleryIndex, tier: Tier, settings: TierSettings, digests: PixelDigests | None = None
) -> tuple[Pairs, int]:
    """Every pair of the tiers up to ``tier`` with its evidence, and how many items have no signature.

    ``digests``: reads the pixel digests of items whose signatures are identical (None: exact copies are
    told by their content hash alone)."""
    settings.check()
    signatures = SignatureTable(index.signatures())
    unsigned = len(index) - len(signatures)
    firsts, seconds, _ = signature_pairs(signatures, settings.edited_bits)
    looser = [firsts], [seconds]
    # The kNN search's cosine: for similar pairs, edited pairs without signatures, and the aligned check.
    cuts = []
    if tier >= Tier.SIMILAR:
        cuts.append(settings.similar_cosine)
    if unsigned and tier >= Tier.EDITED:
        cuts.append(EMBEDDING_ONLY_THRESHOLD)
    aligning = tier >= Tier.EDITED and settings.aligned_ncc is not None and signatures.has_thumbnail.any()
    if aligning:
        cuts.append(settings.aligned_cosine)
    cut = min(cuts, default=None)
    if cut is not None:
        near, other, _ = candidate_pairs(index, cut, neighbours=settings.neighbours)
        looser[0].append(near)
        looser[1].append(other)
    firsts, seconds = np.concatenate(looser[0]), np.concatenate(looser[1])
    keep = _distinct(firsts, seconds)
    firsts, seconds = firsts[keep], seconds[keep]
    bits, turned = _pair_bits(signatures, firsts, seconds)
    cosines = pair_cosines(index, firsts, seconds)
    tiers = classify(bits, turned, cosines, settings)
    alignments = np.full(len(firsts), np.nan, dtype=np.float32)
    checks = 0
    if aligning:
        checks = _align(signatures, firsts, seconds, bits, cosines, tiers, alignments, settings)
    pair_digests: list[str | None] = [None] * len(firsts)
    # Only identical thumbnails can be identical pixels.
    candidates = np.flatnonzero((tiers == int(Tier.EDITED)) & (bits == 0))
    if len(candidates):
        wanted = np.unique(np.concatenate([firsts[candidates], seconds[candidates]]))
        items = index.items.get_many(wanted.tolist())
        pixel = digests([items[int(i)] for i in wanted if int(i) in items]) if digests else {}
        for position in candidates:
            a, b = items.get(int(firsts[position])), items.get(int(seconds[position]))
            if a is None or b is None:
                continue
            if a.content_hash == b.content_hash:
                pair_digests[position] = f"sha256:{a.content_hash}"
            elif pixel.get(a.id) is not None and pixel.get(a.id) == pixel.get(b.id):
                pair_digests[position] = f"pixels:{pixel[a.id]}"
            if pair_digests[position] is not None:
                tiers[position] = int(Tier.EXACT)
    wanted_pairs = tiers <= int(tier)
    pairs = Pairs(
        firsts[wanted_pairs],
        seconds[wanted_pairs],
        bits[wanted_pairs],
        turned[wanted_pairs],
        cosines[wanted_pairs],
        tiers[wanted_pairs],
        [digest for digest, wanted in zip(pair_digests, wanted_pairs, strict=True) if wanted],
        alignments[wanted_pairs],
        checks,
    )
    return pairs, unsigned


def _evidence(pairs: Pairs) -> dict[int, Evidence]:
    """Each item's strongest pair: the strictest tier, then the highest cosine."""
    ends = np.concatenate([pairs.firsts, pairs.seconds])
    others = np.concatenate([pairs.seconds, pairs.firsts])
    rows = np.concatenate([np.arange(len(pairs.firsts))] * 2)
    order = np.lexsort((-pairs.cosines[rows], pairs.tiers[rows], ends))
    first = np.ones(len(order), dtype=bool)
    first[1:] = ends[order][1:] != ends[order][:-1]
    evidence = {}
    for position in order[first]:
        row = rows[position]
        bits = int(pairs.bits[row])
        evidence[int(ends[position])] = Evidence(
            int(others[position]),
            Tier(int(pairs.tiers[row])),
            bits if bits >= 0 else None,
            float(pairs.cosines[row]),
            pairs.digests[row],
            None if np.isnan(pairs.alignments[row]) else round(float(pairs.alignments[row]), 4),
        )
    return evidence


def _group_tiers(pairs: Pairs, found: list[DuplicateGroup]) -> np.ndarray:
    """Each group's tier: the strictest whose pairs alone join all its members. A looser pair inside a
    group does not make it looser (two edits of one photo can be only "similar" to each other, a crop
    and a quarter turn of it, while each is an edited copy of the photo)."""
    members = np.concatenate([group.ids for group in found]) if found else np.zeros(0, np.int64)
    group_of = np.repeat(np.arange(len(found)), [len(group.ids) for group in found])
    ids = np.unique(members)
    tiers = np.zeros(len(found), dtype=np.int64)
    for tier in sorted(Tier, reverse=True):  # loosest first: a stricter tier that joins a group wins
        joined = pairs.tiers <= tier
        component = components(
            len(ids),
            np.searchsorted(ids, pairs.firsts[joined]),
            np.searchsorted(ids, pairs.seconds[joined]),
        )[np.searchsorted(ids, members)]
        # A group is joined at this tier when its members share one component of its pairs.
        lowest, highest = np.full(len(found), len(ids)), np.full(len(found), -1)
        np.minimum.at(lowest, group_of, component)
        np.maximum.at(highest, group_of, component)
        tiers[lowest == highest] = int(tier)
    return tiers


def find_tiered(
    index: GalleryIndex,
    tier: Tier,
    settings: TierSettings | None = None,
    *,
    digests: PixelDigests | None = None,
) -> TieredDuplicates:
    """Groups joined by pairs of ``tier`` or stricter (see the module's doc), largest first."""
    settings = settings or TierSettings()
    pairs, unsigned = tier_pairs(index, tier, settings, digests)
    evidence = _evidence(pairs)
    found = group_pairs(pairs.firsts, pairs.seconds, pairs.cosines)
    groups = [
        TieredGroup(Tier(int(tier_of)), group.ids, [evidence[int(i)] for i in group.ids])
        for group, tier_of in zip(found, _group_tiers(pairs, found), strict=True)
    ]
    return TieredDuplicates(tier, groups, settings, unsigned, len(index), pairs.aligned_checks)


def with_byte_copies(found: TieredDuplicates, copies: dict[int, list[ByteCopy]]) -> TieredDuplicates:
    """``found`` with each item's byte copies (``copies``: item id -> its copies) in the item's group, and
    an exact group for each item with copies and no group; largest groups first."""
    groups = []
    grouped: set[int] = set()
    for group in found.groups:
        grouped.update(int(i) for i in group.ids)
        extra = tuple(copy for i in group.ids for copy in copies.get(int(i), ()))
        groups.append(replace(group, copies=extra) if extra else group)
    for item_id in sorted(set(copies) - grouped):
        own = copies[item_id]
        if own:  # the item's evidence is its pair with a copy (``other``: the item itself)
            groups.append(TieredGroup(Tier.EXACT, np.array([item_id]), [own[0].evidence], tuple(own)))
    groups.sort(key=lambda group: -group.size)  # stable: the pair groups keep their order among equals
    return replace(found, groups=groups)
