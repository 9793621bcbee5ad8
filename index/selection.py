"""Which FAISS index to build for a gallery: size, dimension and a memory budget decide.

The rules follow autofaiss's ``get_optimal_index_keys_v2`` (criteo/autofaiss), adapted to an image
search engine that adds and removes items in place and builds on a few CPU cores:

- fewer than ``FLAT_LIMIT`` vectors: exact search (``flat``). autofaiss switches to HNSW from 1,000
  vectors; below 10,000 an exact scan is at most 10,000 x d multiply-adds a query (well under a
  millisecond at d=512), exact, and supports removal, so HNSW buys nothing here.
- from ``HNSW_FROM`` vectors, ``hnsw`` (M=32, or autofaiss's smaller M) when it fits the budget, as
  autofaiss prefers it whenever it fits. An IVF search scans about sqrt(n) vectors at a fixed share of
  probed lists, a graph walk grows with log(n). Both tuned to recall@10 0.95, HNSW32 (fp16 vectors)
  answered several times faster than IVF-Flat, at a higher recall, on calibrated synthetic vectors at 100k
  and 1M and on 204k real Cars196 views (bench/results/index_bench_*.md). Below 100k, not measured: IVF
  answers there in about a millisecond and builds faster. Removing from a graph leaves tombstones
  (index/faiss_index.py), rebuilt away once they pile up; shards are built as one graph, as faiss cannot
  merge graphs.
- otherwise ``ivf`` (IVF-Flat) when its raw vectors fit the memory budget (or there is none): it removes
  in place, merges shard files with faiss's own tools, loads memory-mapped, and trains in less time than
  a graph takes to build on 2 cores.
- otherwise ``ivfsq`` (IVF with 8-bit scalar quantisation, d bytes a vector) when it fits. autofaiss
  goes straight to PQ; we add this tier because on embedding-like data (tight clusters) SQ8 keeps more
  recall than any PQ code, for more memory (1M x 512 vectors in bench/results/index_bench.md).
- otherwise ``ivfpq``: IVF + product quantisation (no polysemous training: we never filter by Hamming
  distance) with the most accurate code whose index fits the budget, from: 2-dimensional sub-vectors
  with 10-bit codes (5 bits a dimension, from 39 * 1024 vectors on, so every codebook centroid gets
  faiss's minimum of training points), then with 8-bit codes (4 bits a dimension), then autofaiss's
  8-bit codes of 128, 64, 48, ... sub-quantizers of at least 4 dimensions each behind an OPQ rotation.
  The fine codes come first because coarser ones cannot order the neighbours inside a tight cluster,
  whose distances differ by less than their quantisation error: on bench/index_bench.py's 100k
  embedding-like vectors recall@10 fell from ``PQ256x10`` to ``PQ256x8`` and far lower for ``PQ128x8``,
  with or without OPQ. The fine codes get no OPQ rotation: a rotation matters little to
  2-dimensional sub-vectors, and faiss trains OPQ by training the whole PQ again at every iteration.
- ``nlist`` = 4*sqrt(n) rounded to a power of two (autofaiss, below 1M vectors), at most n/39 so every
  centroid gets faiss's minimum of 39 training points; an HNSW coarse quantizer from 16,384 lists on,
  as autofaiss does for large quantizers.
- ``hnsw`` (chosen or forced) uses M=32, or autofaiss's largest M that fits the budget (at least 8), and
  keeps its vectors as 16-bit floats (``SQfp16``): a graph walk's time goes to fetching the vectors of the
  nodes it meets, and half the bytes walk faster at the same recall, in half the memory (1M calibrated
  vectors: bench/results/hnsw_tuning.md against hnsw_tuning_fp32.md, one run after the other). Scores
  then carry fp16's rounding (about 1e-4), as an SQ8 index's carry theirs: ``IndexSpec.exact_scores`` says
  which indexes do. bf16 lost recall (0.978 against 0.986 on 200k clustered 512-d vectors).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass, field

from foundation.errors import InvalidInputError
from foundation.families import IndexType

FLAT_LIMIT = 10_000
MIN_POINTS_PER_CENTROID = 39
HNSW_QUANTIZER_FROM = 16_384
HNSW_FROM = 100_000
HNSW_M = 32
# The graph's vectors: 16-bit floats, 2 bytes a dimension (see the module docstring).
HNSW_STORAGE, HNSW_BYTES_PER_DIM = "SQfp16", 2
PQ_CODE_SIZES = (256, 128, 64, 48, 32, 24, 16, 8, 4)  # autofaiss's sub-quantizer counts for OPQ + PQ
PQ_BITS = 8
PQ_CENTROIDS = 2**PQ_BITS
MIN_PQ_SUBDIM = 4  # OPQ + PQ codes; the fine codes below use 2-dimensional sub-vectors
FINE_PQ_BITS = (10, 8)
ID_BYTES = 8
IDMAP2_BYTES_PER_ID = 48  # IndexIDMap2 keeps the id array and a hash map back from id to position


@dataclass(frozen=True)
class IndexOptions:
    """What the user asked for; ``choose_index`` turns it into an :class:`IndexSpec` for a gallery size."""

    index_type: IndexType = IndexType.AUTO
    memory_budget: int | None = None  # bytes the index may use in RAM; None = no limit
    target_recall: float = 0.95  # recall@10 against exact search that tuning aims for

    def __post_init__(self) -> None:
        object.__setattr__(self, "index_type", _index_type(self.index_type))
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise InvalidInputError("the memory budget must be positive")
        if not 0.0 < self.target_recall <= 1.0:
            raise InvalidInputError(f"target recall must be in (0, 1], got {self.target_recall}")

    def with_changes(self, changes: IndexChanges) -> IndexOptions:
        """These options with the fields that ``changes`` sets replaced (and checked again)."""
        return IndexOptions(
            self.index_type if isinstance(changes.index_type, Keep) else changes.index_type,
            self.memory_budget if isinstance(changes.memory_budget, Keep) else changes.memory_budget,
            self.target_recall if isinstance(changes.target_recall, Keep) else changes.target_recall,
        )


def _index_type(name: str) -> IndexType:
    """``name`` as an index family; a clear error for one that is not."""
    try:
        return IndexType(name)
    except ValueError:
        raise InvalidInputError(
            f"unknown index type {name!r}; choose one of {', '.join(IndexType)}"
        ) from None


def _number(pattern: str, factory: str) -> int | None:
    match = re.search(pattern, factory)
    return int(match.group(1)) if match else None


class Keep(enum.Enum):
    KEEP = "keep"


KEEP = Keep.KEEP  # leave this option as the index was built


@dataclass(frozen=True)
class IndexChanges:
    """The index options a command asks to change; the others keep what the index was built with.

    A sentinel rather than None marks "keep", because None is itself a value: ``memory_budget=None``
    lifts a budget set earlier.
    """

    index_type: IndexType | Keep = KEEP
    memory_budget: int | Keep | None = KEEP
    target_recall: float | Keep = KEEP

    def set_fields(self) -> dict[str, object]:
        """The options this asks to change, by field name."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not KEEP}

    def __bool__(self) -> bool:
        return bool(self.set_fields())


@dataclass(frozen=True)
class IndexSpec:
    """A concrete FAISS index: its family, faiss ``index_factory`` string and dimension. The factory
    string is read once, into the facts the build, search and tuning go by."""

    index_type: IndexType
    factory: str
    dim: int
    nlist: int | None = field(init=False, repr=False, compare=False)  # IVF lists
    hnsw_quantizer: bool = field(init=False, repr=False, compare=False)  # an HNSW graph over the IVF lists
    pq_subquantizers: int | None = field(init=False, repr=False, compare=False)
    pq_bits: int | None = field(init=False, repr=False, compare=False)
    # Whether an OPQ rotation precedes the index (faiss wraps it in an IndexPreTransform).
    opq: bool = field(init=False, repr=False, compare=False)
    hnsw_m: int | None = field(init=False, repr=False, compare=False)
    # Whether searches score with the vectors as added (not through SQ or PQ codes).
    exact_scores: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        facts = {
            "index_type": _index_type(self.index_type),
            "nlist": _number(r"IVF(\d+)", self.factory),
            "hnsw_quantizer": "_HNSW" in self.factory,
            "pq_subquantizers": _number(r",PQ(\d+)", self.factory),
            "pq_bits": _number(r",PQ\d+x(\d+)", self.factory),
            "opq": self.factory.startswith("OPQ"),
            "hnsw_m": _number(r"^IDMap2,HNSW(\d+)", self.factory),
            "exact_scores": re.search(r"SQ|PQ", self.factory) is None,
        }
        for name, value in facts.items():
            object.__setattr__(self, name, value)

    @classmethod
    def parse(cls, index_type: str, factory: str, dim: int) -> IndexSpec:
        """The spec a manifest records, its family a string (checked here)."""
        return cls(_index_type(index_type), factory, dim)

    def memory_bytes(self, count: int) -> int:
        """Estimated RAM of this index holding ``count`` vectors (autofaiss-style arithmetic)."""
        d = self.dim
        if self.index_type is IndexType.FLAT:
            return count * (4 * d + IDMAP2_BYTES_PER_ID)
        if self.index_type is IndexType.IVFSQ:
            return count * (d + ID_BYTES) + (self.nlist or 1) * d * 4 + 2 * d * 4
        if self.index_type is IndexType.HNSW:
            # Graphs built before fp16 storage keep 4-byte floats.
            per_dim = HNSW_BYTES_PER_DIM if self.factory.endswith(f"_{HNSW_STORAGE}") else 4
            return count * (per_dim * d + 2 * 4 * (self.hnsw_m or HNSW_M) + IDMAP2_BYTES_PER_ID)
        centroids = (self.nlist or 1) * d * 4
        if self.index_type is IndexType.IVF:
            return count * (4 * d + ID_BYTES) + centroids
        m, bits = self.pq_subquantizers or 1, self.pq_bits or PQ_BITS
        rotated = m * math.ceil(d / m) if self.opq else d
        rotation = d * rotated * 4 if self.opq else 0
        return count * (math.ceil(m * bits / 8) + ID_BYTES) + centroids + rotation + 2**bits * rotated * 4


def ivf_lists(count: int) -> int:
    """autofaiss's 4*sqrt(n) rounded to a power of two, capped so each list gets 39 training points."""
    target = 2 ** round(math.log2(4 * math.sqrt(max(count, 1))))
    return max(1, min(target, count // MIN_POINTS_PER_CENTROID))


def _ivf_prefix(count: int) -> str:
    nlist = ivf_lists(count)
    return f"IVF{nlist}_HNSW32" if nlist >= HNSW_QUANTIZER_FROM else f"IVF{nlist}"


def _ivfpq(count: int, dim: int, subquantizers: int, bits: int, *, rotate: bool) -> IndexSpec:
    """IVF-PQ, behind an OPQ rotation when asked or when the sub-quantizers do not divide ``dim``."""
    ivf = _ivf_prefix(count)
    rotated = subquantizers * math.ceil(dim / subquantizers)
    if not rotate and rotated == dim:
        return IndexSpec(IndexType.IVFPQ, f"{ivf},PQ{subquantizers}x{bits}np", dim)
    opq = f"OPQ{subquantizers}" if rotated == dim else f"OPQ{subquantizers}_{rotated}"
    return IndexSpec(IndexType.IVFPQ, f"{opq},{ivf},PQ{subquantizers}x{bits}np", dim)


def _pq_candidates(count: int, dim: int) -> list[IndexSpec]:
    """IVF-PQ specs from the most accurate (and largest) code to the smallest."""
    fine = [
        _ivfpq(count, dim, math.ceil(dim / 2), bits, rotate=False)
        for bits in FINE_PQ_BITS
        if bits == PQ_BITS or count >= MIN_POINTS_PER_CENTROID * 2**bits
    ]
    coarse = [_ivfpq(count, dim, m, PQ_BITS, rotate=True) for m in PQ_CODE_SIZES if MIN_PQ_SUBDIM * m <= dim]
    return fine + coarse


def _spec(index_type: IndexType, count: int, dim: int, budget: int | None) -> IndexSpec:
    if index_type is IndexType.FLAT:
        return IndexSpec(IndexType.FLAT, "IDMap2,Flat", dim)
    if index_type is IndexType.IVF:
        return IndexSpec(IndexType.IVF, f"{_ivf_prefix(count)},Flat", dim)
    if index_type is IndexType.IVFSQ:
        return IndexSpec(IndexType.IVFSQ, f"{_ivf_prefix(count)},SQ8", dim)
    if index_type is IndexType.HNSW:
        m = HNSW_M
        if budget is not None:
            # autofaiss: the largest M whose graph (2*M neighbours of 4 bytes) fits beside the vectors.
            per_vector = HNSW_BYTES_PER_DIM * dim + IDMAP2_BYTES_PER_ID
            m = min(HNSW_M, int(((budget / max(count, 1)) - per_vector) // 8))
        return IndexSpec(IndexType.HNSW, f"IDMap2,HNSW{max(m, 8)}_{HNSW_STORAGE}", dim)
    fitting = [s for s in _pq_candidates(count, dim) if budget is None or s.memory_bytes(count) <= budget]
    return fitting[0] if fitting else _pq_candidates(count, dim)[-1]


def choose_index(count: int, dim: int, options: IndexOptions) -> IndexSpec:
    """The index to build for ``count`` vectors of dimension ``dim`` under ``options``.

    Raises ``ValueError`` when nothing fits the memory budget.
    """
    budget = options.memory_budget
    if options.index_type is IndexType.IVFPQ and count < PQ_CENTROIDS:
        raise InvalidInputError(
            f"ivfpq needs at least {PQ_CENTROIDS} vectors to train its 8-bit codebooks; there are {count}"
        )
    if options.index_type is not IndexType.AUTO:
        candidates = [_spec(options.index_type, count, dim, budget)]
    elif count < FLAT_LIMIT:
        candidates = [_spec(IndexType.FLAT, count, dim, budget)]
    else:
        kinds = (
            (IndexType.HNSW, IndexType.IVF, IndexType.IVFSQ)
            if count >= HNSW_FROM
            else (IndexType.IVF, IndexType.IVFSQ)
        )
        candidates = [_spec(kind, count, dim, budget) for kind in kinds]
        candidates += _pq_candidates(count, dim)
    for spec in candidates:
        if budget is None or spec.memory_bytes(count) <= budget:
            return spec
    smallest = min(candidates, key=lambda s: s.memory_bytes(count))
    raise InvalidInputError(
        f"a memory budget of {format_bytes(budget or 0)} is too small for {count} vectors of dimension "
        f"{dim}: the smallest {options.index_type} choice ({smallest.factory}) needs about "
        f"{format_bytes(smallest.memory_bytes(count))}"
    )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"512MB"``, ``"1.5G"``, ``"64k"`` or a plain byte count; K/M/G/T are powers of 1024."""
    match = _SIZE.match(text)
    if not match:
        raise InvalidInputError(f"cannot read {text!r} as a size: write e.g. 512MB, 2G or 1048576")
    number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * 1024 ** " kmgt".index(unit or " "))
    if size <= 0:
        raise InvalidInputError(f"size {text!r} must be positive")
    return size


def format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
