"""int8 export: onnxruntime static quantisation (QDQ) of an exported model, calibrated on gallery images.

The activations' int8 ranges are calibrated on real images decoded and preprocessed exactly as the
server and build-index do, so the ranges match what the model will see. The card records the precision
and the number of calibration images; the fingerprint is that of the int8 file, so an index built with the
fp32 model is refused by the int8 one (their vectors differ a little) and must be rebuilt.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from foundation.errors import InvalidInputError

if TYPE_CHECKING:  # heavy imports stay inside the functions: the CLI imports this module for its default
    import numpy as np

    from engine.model.model_card import ModelCard, Preprocessing

CALIBRATION_BATCH = 16


def calibration_files(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` images of ``folder`` drawn at random (seeded), so that every class and sub-folder can
    appear, not only the first ones in path order."""
    import numpy as np

    from engine.gallery.files import list_images

    files = list_images(folder)
    if not files:
        raise InvalidInputError(f"no images under {folder} to calibrate the int8 model on")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(files), size=min(count, len(files)), replace=False)
    return [files[i] for i in sorted(chosen)]


class ImageCalibrationReader:
    """onnxruntime's ``CalibrationDataReader`` over image files: preprocessed batches, once (one pass is
    what a MinMax calibration takes)."""

    def __init__(self, files: Sequence[Path], preprocessing: Preprocessing, input_name: str) -> None:
        self.input_name = input_name
        self.used = 0
        self._batches = self._read(files, preprocessing)

    def _read(self, files: Sequence[Path], preprocessing: Preprocessing) -> Iterator[np.ndarray]:
        import numpy as np

        from engine.build.prefetch import file_array, prefetch

        batch: list[np.ndarray] = []
        loaded = prefetch(
            files,
            lambda path: file_array(path, preprocessing),
            depth=2 * CALIBRATION_BATCH,
        )
        for _, result in loaded:
            if isinstance(result, Exception):
                continue  # an unreadable file calibrates nothing
            batch.append(result)
            if len(batch) == CALIBRATION_BATCH:
                yield np.stack(batch)
                batch = []
        if batch:
            yield np.stack(batch)

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        if batch is None:
            return None
        self.used += len(batch)
        return {self.input_name: batch}


def quantize_int8(model_path: Path, calibration: Sequence[Path]) -> ModelCard:
    """Replace the fp32 ``model_path`` (with its card) by its int8 version; returns the new card.

    QDQ format (QOperator cannot rewrite this graph's run-time padding), per-channel symmetric int8 weights,
    uint8 activations (onnxruntime's fastest x86 kernels are u8 x s8; with AVX512-VNNI or AVX-VNNI they do
    not saturate, and without VNNI the engine's sessions ask for exact kernels (``engine.model.embedder``), so
    ``reduce_range``, which cost precision everywhere, stays off) with MinMax ranges over ``calibration``.
    The backbone's ``float_under_int8`` layers stay in float (see ``training.backbone``).
    """
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from engine.model.model_card import ModelCard, file_fingerprint
    from foundation.atomic import atomic_path
    from training.backbone import BACKBONES

    card = ModelCard.load(model_path)
    if card.precision != "fp32":
        raise InvalidInputError(f"{model_path} is already {card.precision}")
    with tempfile.TemporaryDirectory() as workdir:
        # Shape inference and graph fusions first, as onnxruntime recommends before quantising.
        prepared = Path(workdir) / "prepared.onnx"
        quant_pre_process(str(model_path), str(prepared))
        keep_float = BACKBONES[card.backbone].float_under_int8
        excluded = [
            node.name
            for node in onnx.load(str(prepared)).graph.node
            if any(fragment in node.name for fragment in keep_float)
        ]
        reader = ImageCalibrationReader(calibration, card.preprocessing, input_name="images")
        # onnxruntime logs a warning for each integer shape tensor of the run-time padding: expected
        # (shapes are not quantised), and noise to whoever exports.
        logging.disable(logging.WARNING)
        try:
            with atomic_path(model_path) as temporary:
                quantize_static(
                    prepared,
                    temporary,
                    reader,
                    quant_format=QuantFormat.QDQ,
                    per_channel=True,
                    reduce_range=False,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax,
                    nodes_to_exclude=excluded,
                )
                fingerprint = file_fingerprint(temporary)
        finally:
            logging.disable(logging.NOTSET)
    if reader.used == 0:
        raise InvalidInputError("none of the calibration images could be read")
    card = card.model_copy(
        update={"fingerprint": fingerprint, "precision": "int8", "calibration_images": reader.used}
    )
    card.save(model_path)
    return card
