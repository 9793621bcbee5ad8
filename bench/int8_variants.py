"""Which int8 quantisation keeps retrieval? Variants of onnxruntime static quantisation against fp32.

    python bench/int8_variants.py --data CARS196/images --calibration CALIBRATION_DIR
                                  [--queries 480] [--calibration-count 300]

The pretrained model is exported once, then quantised per variant (format, activation type, per-channel,
reduce_range, and which layers stay in float), all calibrated with MinMax on the same ``--calibration``
images (seeded draw, as ``dmlsearch export --int8`` does; give training classes, not the test classes
evaluated). Each variant embeds ``--queries`` Cars196 test-class images (every n-th in path order) and is
compared with fp32: the cosine between each image's two embeddings, and the overlap of each image's top-5
neighbours among the others. Speed is images/s at batch 32, fp32 and the variant timed alternately (min
of 5), so that load on a shared machine hits both alike. ``dmlsearch export --int8`` uses the row
``qdq u8s8 per-channel, float: backbone list``.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from lib.options import bench_parser, data_option, out_option, threads_option

from engine.build.prefetch import file_array
from engine.model.embedder import onnx_session
from engine.model.model_card import ModelCard
from foundation import defaults
from foundation.atomic import atomic_write_text
from training.backbone import BACKBONES
from training.data import load_labelled_images, split_classes
from training.features import backbone_model
from training.quantize import ImageCalibrationReader, calibration_files

# (name, QDQ or QOperator, activations, per-channel, reduce_range, layers kept in float)
VARIANTS = [
    ("qdq s8s8 per-channel", "QDQ", "QInt8", True, False, ()),
    ("qdq s8s8 per-tensor", "QDQ", "QInt8", False, False, ()),
    ("qdq u8s8 per-channel", "QDQ", "QUInt8", True, False, ()),
    ("qdq u8s8 per-channel reduce_range", "QDQ", "QUInt8", True, True, ()),
    ("qdq u8s8 per-channel, float: stem", "QDQ", "QUInt8", True, False, ("/conv_stem/",)),
    (
        "qdq u8s8 per-channel, float: pooling + L2 norm",
        "QDQ",
        "QUInt8",
        True,
        False,
        ("/global_pool/", "/Re", "/Div", "/Clip", "/Expand"),
    ),
    ("qdq u8s8 per-channel, float: backbone list", "QDQ", "QUInt8", True, False, None),
    ("qoperator u8s8 per-channel", "QOperator", "QUInt8", True, False, ()),
]


def main() -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    parser = bench_parser(
        __doc__, data_option(), threads_option(2), out_option(Path("bench/results/int8_variants"))
    )
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--calibration-count", type=int, default=defaults.CALIBRATION_IMAGES)
    parser.add_argument("--queries", type=int, default=480)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # onnxruntime's per-shape-tensor warnings

    data = load_labelled_images(args.data)
    test = data.files(split_classes(data)["test"])
    queries = test[:: max(1, len(test) // args.queries)][: args.queries]
    calibration = calibration_files(args.calibration, args.calibration_count)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        fp32 = backbone_model(Path(workdir), "efficientnet_lite0")
        card = ModelCard.load(fp32)
        x = np.stack([file_array(path, card.preprocessing) for path in queries])
        prepared = Path(workdir) / "prepared.onnx"
        quant_pre_process(str(fp32), str(prepared))
        names = [node.name for node in onnx.load(str(prepared)).graph.node]
        cache = Path(workdir) / "calibration.cache"  # one calibration pass serves every variant

        def embed(session: object) -> np.ndarray:
            out = np.concatenate(
                [session.run(None, {"images": x[i : i + 32]})[0] for i in range(0, len(x), 32)]
            )
            return out / np.linalg.norm(out, axis=1, keepdims=True)

        def top5(vectors: np.ndarray) -> np.ndarray:
            similarity = vectors @ vectors.T
            np.fill_diagonal(similarity, -np.inf)
            return np.argsort(-similarity, axis=1)[:, :5]

        reference_session = onnx_session(fp32, threads=args.threads)
        reference = embed(reference_session)
        for name, fmt, activations, per_channel, reduce_range, keep_float in VARIANTS:
            keep_float = BACKBONES[card.backbone].float_under_int8 if keep_float is None else keep_float
            excluded = [n for n in names if any(fragment in n for fragment in keep_float)]
            out = Path(workdir) / "variant.onnx"
            try:
                quantize_static(
                    prepared,
                    out,
                    ImageCalibrationReader(calibration, card.preprocessing, "images"),
                    quant_format=getattr(QuantFormat, fmt),
                    activation_type=getattr(QuantType, activations),
                    weight_type=QuantType.QInt8,
                    per_channel=per_channel,
                    reduce_range=reduce_range,
                    calibrate_method=CalibrationMethod.MinMax,
                    nodes_to_exclude=excluded,
                    calibration_cache_path=cache,
                )
                session = onnx_session(out, threads=args.threads)
            except Exception as err:  # a variant onnxruntime cannot produce or run is a result too
                rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"})
                print(f"{name}: failed: {err}", flush=True)
                continue
            vectors = embed(session)
            cosines = (vectors * reference).sum(axis=1)
            overlap = np.mean(
                [len(set(a) & set(b)) / 5 for a, b in zip(top5(vectors), top5(reference), strict=True)]
            )
            batch = x[:32]
            best = {"fp32": np.inf, "int8": np.inf}
            for _ in range(5):
                for key, s in (("fp32", reference_session), ("int8", session)):
                    started = time.perf_counter()
                    s.run(None, {"images": batch})
                    best[key] = min(best[key], time.perf_counter() - started)
            row = {
                "variant": name,
                "float_nodes": len(excluded),
                "cosine_mean": float(cosines.mean()),
                "cosine_min": float(cosines.min()),
                "top5_overlap": float(overlap),
                "speedup_batch32": best["fp32"] / best["int8"],
            }
            rows.append(row)
            print(row, flush=True)
    command = "python " + shlex.join(sys.argv)
    atomic_write_text(args.out.with_suffix(".json"), json.dumps({"command": command, "rows": rows}, indent=2))
    lines = [
        "# int8 variants vs fp32",
        "",
        f"`{command}`",
        "",
        f"{len(queries)} Cars196 test-class images; MinMax calibration on {len(calibration)} images.",
        "",
        "| variant | layers in float (nodes) | cosine mean | cosine min | top-5 overlap | speed-up b32 |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['variant']} | failed: {row['error'][:80]} | | | | |")
        else:
            lines.append(
                f"| {row['variant']} | {row['float_nodes']} | {row['cosine_mean']:.4f} | "
                f"{row['cosine_min']:.4f} | {row['top5_overlap']:.3f} | {row['speedup_batch32']:.2f}x |"
            )
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
