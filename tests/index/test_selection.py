"""Choosing the index type from gallery size, dimension and memory budget; sizes; shards."""

from __future__ import annotations

import pytest

from index.selection import IndexChanges, IndexOptions, choose_index, ivf_lists, parse_size
from index.sharding import Shard

MB = 1024**2
GB = 1024**3


@pytest.mark.parametrize(
    ("count", "dim", "budget", "expected"),
    [
        (500, 512, None, "IDMap2,Flat"),  # small: exact search
        (9_999, 512, None, "IDMap2,Flat"),
        (99_999, 512, None, "IVF1024,Flat"),  # 4*sqrt(n) = 1265 -> 1024
        (100_000, 512, None, "IDMap2,HNSW32_SQfp16"),  # from HNSW_FROM: a graph when it fits
        (1_000_000, 512, None, "IDMap2,HNSW32_SQfp16"),
        (1_000_000, 512, 2 * GB, "IDMap2,HNSW32_SQfp16"),  # 1.3 GB: fits where IVF's raw floats (2 GB) do not
        (
            1_000_000,
            512,
            1.2 * GB,
            "IDMap2,HNSW27_SQfp16",
        ),  # autofaiss's smaller M: (1.2 GiB / 1M - 1024 - 48) / 8
        (1_000_000, 512, 1.05 * GB, "IVF4096,SQ8"),  # no graph of M >= 8 fits beside the fp16 vectors
        (1_000_000, 512, 512 * MB, "IVF4096,SQ8"),  # raw vectors (2 GB) do not fit, one byte a dimension does
        (1_000_000, 512, 400 * MB, "IVF4096,PQ256x10np"),  # 2-d sub-vectors, 10 bits each: 320 bytes
        (1_000_000, 512, 300 * MB, "IVF4096,PQ256x8np"),  # 2-d sub-vectors, 8 bits each: 256 bytes
        (1_000_000, 512, 256 * MB, "OPQ128,IVF4096,PQ128x8np"),  # then OPQ + codes of >= 4 dimensions
        (1_000_000, 512, 100 * MB, "OPQ64,IVF4096,PQ64x8np"),
        (1_000_000, 100, 64 * MB, "IVF4096,PQ50x8np"),
        (1_000_000, 100, 40 * MB, "OPQ24_120,IVF4096,PQ24x8np"),  # rotated to a multiple of the code size
        (100_000_000, 512, 100 * GB, "IVF32768_HNSW32,SQ8"),  # a graph over the many coarse centroids
    ],
)
def test_automatic_choice(count: int, dim: int, budget: float | None, expected: str) -> None:
    budget = None if budget is None else int(budget)
    spec = choose_index(count, dim, IndexOptions(memory_budget=budget))
    assert spec.factory == expected
    if budget is not None:
        assert spec.memory_bytes(count) <= budget


def test_forced_types_and_budget_errors() -> None:
    assert choose_index(50_000, 64, IndexOptions("flat")).factory == "IDMap2,Flat"
    assert choose_index(50_000, 64, IndexOptions("hnsw")).factory == "IDMap2,HNSW32_SQfp16"
    # autofaiss's rule: the largest M whose graph fits beside fp16 vectors: (300 MiB / 1M - 2*64 - 48) / 8
    assert (
        choose_index(1_000_000, 64, IndexOptions("hnsw", memory_budget=300 * MB)).factory
        == "IDMap2,HNSW17_SQfp16"
    )
    assert choose_index(50_000, 64, IndexOptions("ivf")).factory == "IVF1024,Flat"
    assert choose_index(50_000, 64, IndexOptions("ivfsq")).factory == "IVF1024,SQ8"
    # With no budget the most accurate code; 10-bit codes once each of their 1024 centroids gets 39 points.
    assert choose_index(50_000, 64, IndexOptions("ivfpq")).factory == "IVF1024,PQ32x10np"
    assert choose_index(30_000, 64, IndexOptions("ivfpq")).factory == "IVF512,PQ32x8np"
    assert choose_index(1_000, 15, IndexOptions("ivfpq")).factory == "OPQ8_16,IVF25,PQ8x8np"  # odd: padded
    with pytest.raises(ValueError, match="too small"):
        choose_index(1_000_000, 512, IndexOptions(memory_budget=4 * MB))
    with pytest.raises(ValueError, match="too small"):
        choose_index(1_000_000, 512, IndexOptions("flat", memory_budget=512 * MB))
    with pytest.raises(ValueError, match="at least 256"):
        choose_index(100, 64, IndexOptions("ivfpq"))
    with pytest.raises(ValueError, match="unknown index type"):
        IndexOptions("lsh")
    with pytest.raises(ValueError, match="target recall"):
        IndexOptions(target_recall=1.5)


def test_changes_replace_only_the_options_they_name() -> None:
    built = IndexOptions("ivf", memory_budget=64 * MB, target_recall=0.9)
    assert built.with_changes(IndexChanges()) == built
    assert not IndexChanges() and IndexChanges(memory_budget=None)
    assert built.with_changes(IndexChanges(memory_budget=None)) == IndexOptions("ivf", None, 0.9)
    assert built.with_changes(IndexChanges(index_type="auto", target_recall=0.99)) == IndexOptions(
        "auto", 64 * MB, 0.99
    )
    with pytest.raises(ValueError, match="unknown index type"):
        built.with_changes(IndexChanges(index_type="lsh"))  # changed options are checked again


def test_ivf_lists_leave_every_centroid_enough_training_points() -> None:
    assert ivf_lists(100) == 2
    assert ivf_lists(20) == 1
    assert all(ivf_lists(n) * 39 <= n for n in (50, 1_000, 12_345, 10**6))


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MB", 512 * MB), ("2G", 2 * 1024**3), ("1.5GiB", int(1.5 * 1024**3)), ("4096", 4096)],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-5MB", "0", "12XB"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_shards_split_paths_deterministically_and_completely() -> None:
    paths = [f"class{i % 13}/img_{i}.jpg" for i in range(2000)]
    shards = [Shard.parse(f"{i}/3") for i in range(3)]
    owners = [[shard.owns(path) for shard in shards] for path in paths]
    assert all(sum(row) == 1 for row in owners)  # each path in exactly one shard
    sizes = [sum(row[i] for row in owners) for i in range(3)]
    assert min(sizes) > 550  # roughly even
    assert [Shard(1, 3).owns(p) for p in paths] == [shards[1].owns(p) for p in paths]
    assert str(Shard.parse(" 2 / 4 ")) == "2/4"
    for bad in ("3/3", "1", "a/b", "0/0"):
        with pytest.raises(ValueError):
            Shard.parse(bad)
