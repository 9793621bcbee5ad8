"""The aligned check: whether one image is a window of the other (an off-centre or tight crop, maybe
re-encoded, rotated a little or colour-adjusted), from the greyscale thumbnails signatures carry
(``engine.duplicates.signature_layout``).

A crop moves every pHash view by 10-21 bits (bench/results/crop_alignment.md), but its thumbnail is the
other thumbnail's window at some scale and offset. So: the best normalised cross-correlation (NCC) of one
thumbnail, shrunk per axis to each share in ``SCALES``, over every offset inside the other, both ways
round. NCC ignores brightness and contrast; another photo of the same thing does not line up with it.
Images with little in them can line up by shape alone (two different objects centred on a plain
background, a dark frame with one light: NCC ~0.9 in a quick check): the pair's cosine must hold too.

Coarse to fine, on many pairs at once in plain array maths: every scale, offset and way round on the
thumbnails pooled to half their side, then the full thumbnails at each pair's best coarse way round and
scale and half a scale step either side per axis (every offset), where the coarse NCC reaches
``COARSE_FLOOR``. Shrinking is two matrix products with
area weights; the correlation one product per offset; window means and spreads come from summed-area
tables (as ``skimage.feature.match_template`` computes the NCC, there for one pair at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

SCALES = (0.7, 0.8, 0.9, 1.0)  # per-axis shares of the other thumbnail's side a window may take
FINE_STEP = 0.05  # the fine stage's scales: the coarse best and this much either side, per axis
# Pairs whose coarse NCC is below this keep it, without the fine stage (~80% of the cost): far below any
# cut tried (bench/duplicate_tiers.py: 0.70-0.94), and copies score higher coarse than fine.
COARSE_FLOOR = 0.6
_BATCH = 512  # pairs at a time: the fine stage's windows stay a few MB


def _shrink_weights(size: int, share: float) -> np.ndarray:
    """``(round(size * share), size)`` area weights: each output pixel the mean of the input it covers."""
    out = round(size * share)
    edges = np.linspace(0.0, size, out + 1)
    starts, ends = edges[:-1, None], edges[1:, None]
    pixels = np.arange(size)[None, :]
    overlap = np.clip(np.minimum(ends, pixels + 1) - np.maximum(starts, pixels), 0.0, None)
    return (overlap / overlap.sum(axis=1, keepdims=True)).astype(np.float32)


def _narrow(images: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """``image @ columns.T`` for every image, as one large product."""
    count, size, _ = images.shape
    return (images.reshape(count * size, size) @ columns.T).reshape(count, size, -1)


def _shrink(narrowed: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``rows @ narrowed`` for every (narrowed) image, as one large product."""
    return np.tensordot(rows, narrowed, axes=([1], [1])).transpose(1, 0, 2)


def _window_sums(table: np.ndarray, h: int, w: int) -> np.ndarray:
    return table[:, h:, w:] - table[:, :-h, w:] - table[:, h:, :-w] + table[:, :-h, :-w]


class _Wholes:
    """Thumbnails to find windows in, with their summed-area tables."""

    def __init__(self, images: np.ndarray) -> None:
        self.images = images
        padded = np.pad(images, ((0, 0), (1, 0), (1, 0)))  # centred on each image's mean, in [-1, 1]
        self.sums, self.squares = padded.cumsum(1).cumsum(2), (padded**2).cumsum(1).cumsum(2)

    def best_ncc(self, templates: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """The best NCC of each template (``(pairs, h, w)``) over every offset inside its whole."""
        _, h, w = templates.shape
        templates = templates - templates.mean(axis=(1, 2), keepdims=True)
        norms = np.sqrt((templates**2).sum(axis=(1, 2)))
        images = self.images[rows]
        size = images.shape[1]
        # One product per offset: faster here than an einsum over sliding windows or an FFT per pair.
        correlation = np.empty((len(templates), size - h + 1, size - w + 1), dtype=np.float32)
        for top in range(size - h + 1):
            for left in range(size - w + 1):
                window = images[:, top : top + h, left : left + w]
                correlation[:, top, left] = np.einsum("nhw,nhw->n", window, templates)
        spread = _window_sums(self.squares[rows], h, w) - _window_sums(self.sums[rows], h, w) ** 2 / (h * w)
        scores = correlation / (np.sqrt(np.maximum(spread, 1e-6)) * norms[:, None, None] + 1e-6)
        return scores.reshape(len(templates), -1).max(axis=1)


def _pool(images: np.ndarray) -> np.ndarray:
    count, size, _ = images.shape
    return images.reshape(count, size // 2, 2, size // 2, 2).mean(axis=(2, 4))


def _centred(images: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1], each image's mean 0: its summed-area tables stay exact enough in float32."""
    scaled = images.astype(np.float32) / 255
    return scaled - scaled.mean(axis=(1, 2), keepdims=True)


def _aligned(
    firsts: np.ndarray, seconds: np.ndarray, scales: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray]:
    count, size, _ = firsts.shape
    combos = [(way, y, x) for way in (0, 1) for y in scales for x in scales]
    coarse = np.empty((count, len(combos)), dtype=np.float32)
    pooled = [_pool(firsts), _pool(seconds)]
    wholes = [_Wholes(images) for images in pooled]
    small = {share: _shrink_weights(size // 2, share) for share in scales}
    narrowed = {(way, x): _narrow(pooled[1 - way], small[x]) for way in (0, 1) for x in scales}
    for number, (way, y, x) in enumerate(combos):
        coarse[:, number] = wholes[way].best_ncc(_shrink(narrowed[way, x], small[y]))
    chosen = np.array(combos)[coarse.argmax(axis=1)]
    best = coarse.max(axis=1)
    finer = best >= COARSE_FLOOR
    # The coarse scale is a step of SCALES off at worst: the fine stage tries it and the scales half a
    # step either side on each axis (a crop to 85% lies between 0.8 and 0.9).
    low, high = min(scales), max(scales)
    full = [_Wholes(firsts), _Wholes(seconds)]
    best[finer] = -1.0
    tried: dict[tuple[int, float, float], list[int]] = {}
    for row in np.flatnonzero(finer).tolist():
        way, y, x = chosen[row].tolist()
        for dy in (-FINE_STEP, 0.0, FINE_STEP):
            for dx in (-FINE_STEP, 0.0, FINE_STEP):
                fine_y, fine_x = round(y + dy, 3), round(x + dx, 3)
                if low <= fine_y <= high and low <= fine_x <= high:
                    tried.setdefault((int(way), fine_y, fine_x), []).append(row)
    weights: dict[float, np.ndarray] = {}
    for (way, y, x), found in tried.items():
        rows = np.array(found)
        for share in (y, x):
            weights.setdefault(share, _shrink_weights(size, share))
        parts = (seconds, firsts)[way][rows]
        scores = full[way].best_ncc(_shrink(_narrow(parts, weights[x]), weights[y]), rows)
        best[rows] = np.maximum(best[rows], scores)
    return best, chosen[:, 0] == 0  # way 0: the second thumbnail is the window, found in the first


@dataclass(frozen=True)
class Alignments:
    ncc: np.ndarray  # each pair's aligned NCC in [-1, 1]
    first_holds: np.ndarray  # bool: the second image is a window of the first (else the other way round)


def aligned_ncc(firsts: np.ndarray, seconds: np.ndarray, scales: tuple[float, ...] = SCALES) -> Alignments:
    """Each pair's aligned NCC (see the module's doc) from ``(pairs, s, s)`` thumbnails (``s`` even), and
    which of the two holds the other; a flat thumbnail (no spread) scores 0 against anything. At the full
    scale either image holds the other: ``first_holds`` is then the better way by a rounding."""
    scores, holds = [np.zeros(0, dtype=np.float32)], [np.zeros(0, dtype=bool)]
    # Many small products: BLAS threads only wait for each other (docs/measurements.md).
    with threadpool_limits(limits=1, user_api="blas"):
        for start in range(0, len(firsts), _BATCH):
            a, b = (_centred(images[start : start + _BATCH]) for images in (firsts, seconds))
            best, first_holds = _aligned(a, b, scales)
            scores.append(best)
            holds.append(first_holds)
    return Alignments(np.clip(np.concatenate(scores), -1.0, 1.0), np.concatenate(holds))
