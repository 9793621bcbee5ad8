"""Why a result matched: the cosine of two images split over the positions of each, exactly.

An explainable model (``model.json`` names an explainer, ``engine.model.model_card.ExplainerCard``) outputs
its feature map beside the embedding; its explainer graph splits the embedding ``e`` of each image over the
map's positions: ``e = sum_p c_p + r`` (``training.model.PositionContributions``). The cosine of two images
``a`` and ``b`` is ``<e_a, e_b> = sum_p <c_{a,p}, e_b> + <r_a, e_b>``: the heatmap of ``a`` is ``<c_{a,p},
e_b>`` over its positions, each one's exact share of the served cosine, and ``<r_a, e_b>`` is what no
position carries (the head's biases). The same holds for ``b`` against ``e_a``. Everything runs through
onnxruntime; both images are embedded in one run (two images: what one explanation costs).

The same split, taken on both sides at once, is over pairs of positions: ``<e_a, e_b> = sum_{p,q} <c_{a,p},
c_{b,q}> + <r_a, e_b> + <sum_p c_{a,p}, r_b>``. Each heatmap names its peak, from that: the square window of
positions in ``a`` and the one in ``b`` that match each other most specifically (:func:`matched_windows`),
with the share of the cosine their pairs carry between them, an exact term of the served cosine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.decode.model_input import decode_uploads
from engine.decode.pool import gallery_memory_is_the_servers
from engine.decode.regions import Box
from engine.model.model_card import ModelCard, Preprocessing
from engine.serve.item_reader import ItemReader, image_path
from engine.serve.loaded_bundle import CurrentBundle, LoadedBundle, ServingConfig
from engine.serve.query import ItemQuery, Query
from foundation.defaults import EXPLAIN_PEAK_POSITIONS
from foundation.errors import DmlsearchError


class ExplainUnavailableError(DmlsearchError, ValueError):
    """The served model has no explainer (exported before explanations existed, or not explainable)."""

    code = "explain_unavailable"


@dataclass(frozen=True)
class Peak:
    """A square window of grid positions: one of the two regions that matched (:func:`matched_windows`)."""

    top: int  # grid row of its first position
    left: int  # grid column of its first position
    size: int  # positions on each side
    share: float  # the part of the cosine carried between this window and the other image's peak window

    def box(self, grid_shape: tuple[int, int], view_size: tuple[int, int]) -> tuple[int, int, int, int]:
        """``(x0, y0, x1, y1)``: the window in pixels of the view ``(width, height)`` the grid covers."""
        (rows, columns), (width, height) = grid_shape, view_size
        return (
            round(self.left * width / columns),
            round(self.top * height / rows),
            round((self.left + self.size) * width / columns),
            round((self.top + self.size) * height / rows),
        )


def window_sums(values: np.ndarray, size: int) -> np.ndarray:
    """Sums of ``values`` (h, w, ...) over each ``size`` x ``size`` window inside the grid, indexed by the
    window's first position: (h - size + 1, w - size + 1, ...)."""
    return sliding_window_view(values, (size, size), axis=(0, 1)).sum(axis=(-2, -1))


def matched_windows(
    query: np.ndarray, item: np.ndarray, size: int = EXPLAIN_PEAK_POSITIONS
) -> tuple[Peak, Peak]:
    """The window of the query and the window of the item, ``size`` x ``size`` positions (fewer on a smaller
    grid), that show the same thing most specifically, from the contributions (h, w, d) of each image.

    ``A[p, p'] = cos(query_p, item_p')`` says whether two positions add the same thing to the embeddings:
    the direction of their contributions, not how much they add (a salient region adds much, whatever it
    matches). Centred on both sides (less its mean over the item's positions and over the query's), a
    position that is a little alike everything in the other image (a busy background) scores nothing; the
    pair of windows whose position pairs score the most is chosen. Both peaks get the pair's exact share of
    the cosine, ``S[U, V] = sum_{p in U, p' in V} <query_p, item_p'>``.
    """
    size = min(size, *query.shape[:2], *item.shape[:2])
    alike = np.einsum("ijd,kld->ijkl", _directions(query), _directions(item))
    specific = alike - alike.mean(axis=(2, 3), keepdims=True) - alike.mean(axis=(0, 1), keepdims=True)
    # Sum over the query's windows (axes 0, 1), then over the item's: (item windows, query windows).
    pairs = window_sums(window_sums(specific, size).transpose(2, 3, 0, 1), size)
    top_i, left_i, top_q, left_q = (int(n) for n in np.unravel_index(int(np.argmax(pairs)), pairs.shape))
    share = float(
        query[top_q : top_q + size, left_q : left_q + size].sum(axis=(0, 1))
        @ item[top_i : top_i + size, left_i : left_i + size].sum(axis=(0, 1))
    )
    return Peak(top_q, left_q, size, share), Peak(top_i, left_i, size, share)


def _directions(contributions: np.ndarray) -> np.ndarray:
    """Each position's contribution scaled to unit length (a position that adds nothing stays zero)."""
    lengths = np.linalg.norm(contributions, axis=-1, keepdims=True)
    return contributions / np.maximum(lengths, np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class Heatmap:
    """One image's share of the cosine: ``grid.sum() + rest`` is the cosine (within float rounding)."""

    grid: np.ndarray  # float32 (h, w): each position's share; the grid covers the model's view
    rest: float  # the share no position carries (the head's biases)
    view: (
        np.ndarray
    )  # uint8 (s, s, 3): the image as the model saw it (the centre square of the upright image)
    peak: Peak  # its window of the two that matched (matched_windows)

    @property
    def total(self) -> float:
        return float(self.grid.sum()) + self.rest

    @property
    def peak_box(self) -> tuple[int, int, int, int]:
        """The peak window in pixels of the view."""
        return self.peak.box(self.grid.shape, (self.view.shape[1], self.view.shape[0]))


@dataclass(frozen=True)
class Explanation:
    cosine: float  # the cosine of the two served embeddings
    query: Heatmap
    item: Heatmap
    model_fingerprint: str

    def in_words(self) -> list[str]:
        """What the explanation says, a sentence a line: the PNG's caption, ``dmlsearch explain``'s output
        and the API's ``summary``. The model's fixed offset (the rest) is said only where it is felt."""
        cosine = self.cosine
        outlined = share_of_match(self.query.peak.share, cosine)
        lines = [
            f"Similarity {self.cosine:.3f} (the cosine of the two embeddings; 1 is the same picture).",
            "Coloured: the areas that made the two images alike, brighter for more.",
            f"The outlined regions, one in each image, carry {outlined}.",
        ]
        if max(abs(self.query.rest), abs(self.item.rest)) >= REST_WORTH_SAYING:
            lines.append(
                f"No area but the model's fixed offset carries {share_of_match(self.query.rest, cosine)} on "
                f"the query's side, {share_of_match(self.item.rest, cosine)} on the result's."
            )
        return lines


# Below this (in cosine), the share no area carries (the head's biases) goes unsaid.
REST_WORTH_SAYING = 0.005


def share_of_match(part: float, cosine: float) -> str:
    """``part`` of the cosine in words: "2.6% of the match" where the images match (a positive cosine);
    else the number itself, as there is no match to take a share of."""
    if cosine <= 0.0:
        return f"{part:+.3f} of a similarity of {cosine:.3f}"
    fraction = part / cosine
    return f"{fraction:.{1 if abs(fraction) < 0.1 else 0}%} of the match"


def unavailable_message(model_path: Path, card: ModelCard) -> str:
    if card.explainer is not None:
        return (
            f"the served model's explainer {card.explainer.path_beside(model_path)} is missing: copy it "
            f"beside {model_path.name} (it is exported with it) and reload"
        )
    return (
        f"the served model ({card.backbone}, exported {card.created}) has no explainer: re-export it with "
        "this version of dmlsearch export (an average-pooled backbone, with or without the trained head) "
        "and rebuild the index with it (dmlsearch index rebuild)"
    )


def explain_tensor(
    bundle: LoadedBundle, tensor: np.ndarray
) -> tuple[float, tuple[np.ndarray, np.ndarray], tuple[float, float], tuple[Peak, Peak]]:
    """The cosine of two preprocessed images (2, 3, s, s), each one's grid and rest against the other and
    their matched peak windows."""
    if bundle.explainer is None:
        raise ExplainUnavailableError(unavailable_message(bundle.embedder.model_path, bundle.embedder.card))
    embeddings, maps = bundle.embedder.embed_with_maps(tensor)
    contributions, rest = bundle.explainer.split(maps)
    others = embeddings[::-1]  # each image against the other one's embedding
    grids = np.einsum("nhwd,nd->nhw", contributions, others)
    rests = np.einsum("nd,nd->n", rest, others)
    peaks = matched_windows(contributions[0], contributions[1])
    cosine = float(embeddings[0] @ embeddings[1])
    return cosine, (grids[0], grids[1]), (float(rests[0]), float(rests[1])), peaks


def model_view(image: np.ndarray, preprocessing: Preprocessing) -> np.ndarray:
    """A preprocessed CHW image back to the uint8 RGB square the model saw."""
    mean = np.asarray(preprocessing.mean, dtype=np.float32)
    std = np.asarray(preprocessing.std, dtype=np.float32)
    pixels = (image.transpose(1, 2, 0) * std + mean) * 255.0
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


class ExplainService:
    """Explains a query (an upload or an item) against one item of the served index."""

    def __init__(self, current: CurrentBundle, reader: ItemReader, config: ServingConfig) -> None:
        self.current = current
        self.reader = reader
        self.config = config

    def explain(self, query: Query, item_id: int, box: Box | None = None) -> Explanation:
        """Why ``item_id`` matched ``query`` (its ``box`` region, when given: the query the search ran).
        Raises ``ItemNotFoundError`` for an unknown item, ``ImageDecodeError`` for a bad upload (before
        any model work) and ``ExplainUnavailableError`` when the served model has no explainer."""
        with self.current.reading() as bundle:  # the files of the items of this bundle
            if bundle.explainer is None:
                raise ExplainUnavailableError(
                    unavailable_message(bundle.embedder.model_path, bundle.embedder.card)
                )
            # The items' files by their paths: the decode process reads them, not this one.
            item_file = image_path(bundle, item_id)
            query_image = image_path(bundle, query.item_id) if isinstance(query, ItemQuery) else query
        preprocessing = bundle.embedder.card.preprocessing
        images = [query_image, item_file]
        with gallery_memory_is_the_servers(images):
            decoded = self.config.decoder.run(
                decode_uploads,
                images,
                self.config.budget(bundle.embedder),
                preprocessing,
                boxes=[box, None],
                images=len(images),
            )
        cosine, grids, rests, peaks = explain_tensor(bundle, decoded.tensor)
        query_map, item_map = (
            Heatmap(grid, rest, model_view(image, preprocessing), peak)
            for grid, rest, image, peak in zip(grids, rests, decoded.tensor, peaks, strict=True)
        )
        return Explanation(cosine, query_map, item_map, bundle.embedder.fingerprint)
