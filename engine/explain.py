"""Why a result matched: the cosine of two images split over the positions of each, exactly.

An explainable model (``model.json`` names an explainer, ``engine.model_card.ExplainerCard``) outputs its
feature map beside the embedding; its explainer graph splits the embedding ``e`` of each image over the
map's positions: ``e = sum_p c_p + r`` (``training.model.PositionContributions``). The cosine of two images
``a`` and ``b`` is ``<e_a, e_b> = sum_p <c_{a,p}, e_b> + <r_a, e_b>``: the heatmap of ``a`` is ``<c_{a,p},
e_b>`` over its positions, each one's exact share of the served cosine, and ``<r_a, e_b>`` is what no
position carries (the head's biases). The same holds for ``b`` against ``e_a``. Everything runs through
onnxruntime; both images are embedded in one run (two images: what one explanation costs).

Each heatmap names its peak (:func:`peak_window`): the square window of positions whose shares add up to the
most, itself an exact share of the cosine (a sum of positions' shares), not a smoothed or rescaled one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.decoding import decode_uploads
from engine.defaults import EXPLAIN_PEAK_POSITIONS
from engine.item_reader import ItemReader, image_path
from engine.model_card import ModelCard, Preprocessing
from engine.query import ItemQuery, Query
from engine.regions import Box
from engine.serving import CurrentBundle, LoadedBundle, ServingConfig
from index.errors import DmlsearchError


class ExplainUnavailableError(DmlsearchError, ValueError):
    """The served model has no explainer (exported before explanations existed, or not explainable)."""

    code = "explain_unavailable"


@dataclass(frozen=True)
class Peak:
    """The square window of grid positions that carries the largest share of the cosine."""

    top: int  # grid row of its first position
    left: int  # grid column of its first position
    size: int  # positions on each side
    share: float  # the sum of its positions' shares: the part of the cosine the window carries

    def box(self, grid_shape: tuple[int, int], view_size: tuple[int, int]) -> tuple[int, int, int, int]:
        """``(x0, y0, x1, y1)``: the window in pixels of the view ``(width, height)`` the grid covers."""
        (rows, columns), (width, height) = grid_shape, view_size
        return (
            round(self.left * width / columns),
            round(self.top * height / rows),
            round((self.left + self.size) * width / columns),
            round((self.top + self.size) * height / rows),
        )


def peak_window(grid: np.ndarray, size: int = EXPLAIN_PEAK_POSITIONS) -> Peak:
    """The ``size`` x ``size`` window of ``grid`` (fewer on a smaller grid) whose shares add up to the most.

    Windows lie inside the grid: each one is a region of the image, and its share is exactly what that
    region carries of the cosine (the shares add up).
    """
    size = min(size, *grid.shape)
    sums = sliding_window_view(grid, (size, size)).sum(axis=(-2, -1))
    top, left = np.unravel_index(int(np.argmax(sums)), sums.shape)
    return Peak(int(top), int(left), size, float(sums[top, left]))


@dataclass(frozen=True)
class Heatmap:
    """One image's share of the cosine: ``grid.sum() + rest`` is the cosine (within float rounding)."""

    grid: np.ndarray  # float32 (h, w): each position's share; the grid covers the model's view
    rest: float  # the share no position carries (the head's biases)
    view: (
        np.ndarray
    )  # uint8 (s, s, 3): the image as the model saw it (the centre square of the upright image)

    @property
    def total(self) -> float:
        return float(self.grid.sum()) + self.rest

    @property
    def peak(self) -> Peak:
        return peak_window(self.grid)

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
) -> tuple[float, tuple[np.ndarray, np.ndarray], tuple[float, float]]:
    """The cosine of two preprocessed images (2, 3, s, s) and each one's grid and rest against the other."""
    if bundle.explainer is None:
        raise ExplainUnavailableError(unavailable_message(bundle.embedder.model_path, bundle.embedder.card))
    embeddings, maps = bundle.embedder.embed_with_maps(tensor)
    contributions, rest = bundle.explainer.split(maps)
    others = embeddings[::-1]  # each image against the other one's embedding
    grids = np.einsum("nhwd,nd->nhw", contributions, others)
    rests = np.einsum("nd,nd->n", rest, others)
    return float(embeddings[0] @ embeddings[1]), (grids[0], grids[1]), (float(rests[0]), float(rests[1]))


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
            item_bytes = image_path(bundle, item_id).read_bytes()
            query_bytes = (
                image_path(bundle, query.item_id).read_bytes() if isinstance(query, ItemQuery) else query
            )
        preprocessing = bundle.embedder.card.preprocessing
        images = [query_bytes, item_bytes]
        decoded = self.config.decoder.run(
            decode_uploads,
            images,
            self.config.budget(bundle.embedder),
            preprocessing,
            boxes=[box, None],
            images=len(images),
        )
        cosine, grids, rests = explain_tensor(bundle, decoded.tensor)
        query_map, item_map = (
            Heatmap(grid, rest, model_view(image, preprocessing))
            for grid, rest, image in zip(grids, rests, decoded.tensor, strict=True)
        )
        return Explanation(cosine, query_map, item_map, bundle.embedder.fingerprint)
