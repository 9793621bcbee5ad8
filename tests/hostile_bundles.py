"""Hostile index directories for reload: copies of a served index whose files pass every load-time check
but would break searches (a model whose output has the wrong size, is NaN or never comes, corrupt vector
blobs). Made by the tests themselves, with the onnx package's graph helpers."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine.model.bundle import STORED_MODEL
from engine.model.model_card import ModelCard, file_fingerprint
from index.manifest import Manifest

# The Loop's trip count: at a microsecond an iteration, longer than anyone waits.
ENDLESS_TRIP_COUNT = 2**62
HOSTILE_MODELS = ("narrow", "nan", "endless")


def _graph(kind: str, dim: int) -> onnx.GraphProto:
    """input (N, 3, H, W) -> mean colour (N, 3) -> a linear map to ``dim`` numbers, then spoilt by ``kind``:
    narrow: 64 numbers, not ``dim``; nan: every number NaN; endless: a Loop of 2^62 steps before the output
    (its start depends on the input, so that no graph optimisation can fold it away at load time)."""
    width = 64 if kind == "narrow" else dim
    weights = np.random.default_rng(0).standard_normal((3, width)).astype(np.float32)
    nodes = [
        helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["colour"]),
        helper.make_node("MatMul", ["colour", "weights"], ["linear"]),
    ]
    initializers = [numpy_helper.from_array(weights, "weights")]
    if kind in ("narrow",):
        nodes.append(helper.make_node("Identity", ["linear"], ["output"]))
    elif kind == "nan":
        initializers.append(numpy_helper.from_array(np.array([np.nan], np.float32), "nan"))
        nodes.append(helper.make_node("Mul", ["linear", "nan"], ["output"]))
    elif kind == "endless":
        body = helper.make_graph(
            [
                helper.make_node("Identity", ["condition"], ["condition_out"]),
                helper.make_node("Add", ["carried", "one"], ["carried_out"]),
            ],
            "step",
            [
                helper.make_tensor_value_info("iteration", TensorProto.INT64, []),
                helper.make_tensor_value_info("condition", TensorProto.BOOL, []),
                helper.make_tensor_value_info("carried", TensorProto.FLOAT, None),
            ],
            [
                helper.make_tensor_value_info("condition_out", TensorProto.BOOL, []),
                helper.make_tensor_value_info("carried_out", TensorProto.FLOAT, None),
            ],
            [numpy_helper.from_array(np.array(1.0, np.float32), "one")],
        )
        initializers += [
            numpy_helper.from_array(np.array(ENDLESS_TRIP_COUNT, np.int64), "trips"),
            numpy_helper.from_array(np.array(True), "keep_going"),
        ]
        nodes += [
            helper.make_node("ReduceSum", ["linear"], ["start"], keepdims=0),
            helper.make_node("Loop", ["trips", "keep_going", "start"], ["end"], body=body),
            helper.make_node("Add", ["linear", "end"], ["output"]),
        ]
    else:
        raise ValueError(f"no hostile model {kind!r}: one of {HOSTILE_MODELS}")
    return helper.make_graph(
        nodes,
        kind,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", width])],
        initializers,
    )


def with_hostile_model(index: Path, out: Path, kind: str) -> Path:
    """A copy of ``index`` carrying the hostile model ``kind`` (its card and the manifest say it is the
    model the index was built with, with the index's dimension)."""
    shutil.copytree(index, out)
    manifest = Manifest.load(out)
    model = onnx.helper.make_model(
        _graph(kind, manifest.dim), opset_imports=[helper.make_opsetid("", 17)], ir_version=8
    )
    target = out / STORED_MODEL
    target.unlink()  # copytree keeps no hard link, but be sure the served file is never written through
    onnx.save(model, target)
    card = ModelCard.load(index / STORED_MODEL)
    card = card.model_copy(update={"fingerprint": file_fingerprint(target), "reranker": None})
    card.save(target)
    manifest.model_fingerprint = card.fingerprint
    manifest.save(out)
    return out


def with_corrupt_vectors(index: Path, out: Path) -> Path:
    """A copy of ``index`` whose ``items.sqlite`` holds vector blobs cut short and overwritten."""
    shutil.copytree(index, out)
    with sqlite3.connect(out / "items.sqlite") as db:
        (first, second) = [row[0] for row in db.execute("SELECT id FROM vectors ORDER BY id LIMIT 2")]
        db.execute("UPDATE vectors SET vector = substr(vector, 1, 100) WHERE id = ?", (first,))
        db.execute("UPDATE vectors SET vector = 'not a vector' WHERE id = ?", (second,))
    return out


def with_garbage_vectors(index: Path, out: Path) -> Path:
    """A copy of ``index`` whose vector blobs have the right length but random contents."""
    shutil.copytree(index, out)
    with sqlite3.connect(out / "items.sqlite") as db:
        db.execute("UPDATE vectors SET vector = randomblob(length(vector)) WHERE id % 3 = 0")
    return out
