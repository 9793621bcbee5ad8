"""Embed images with an exported ONNX model through onnxruntime."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
from PIL import Image

from engine.model.model_card import MAPS_OUTPUT, ModelCard, check_fingerprint
from engine.model.preprocess import to_tensor
from foundation.errors import (
    DmlsearchError,
    ErrorKind,
    MissingDependencyError,
    NotFoundError,
    UnavailableError,
)
from foundation.priority import lowering, run_lowered
from foundation.regular_files import require_regular
from index.protocol import normalize_rows

# How onnxruntime's arena reports an allocation it could not make (bfc_arena.cc).
ONNX_ALLOCATION_FAILED = "Failed to allocate memory"
# onnxruntime ships no type information: its InferenceSession is untyped.
OnnxSession: TypeAlias = Any


class EmbedTimeoutError(DmlsearchError, RuntimeError):
    """A model run overran its deadline and was stopped (its thread and compute slot are free again)."""

    kind = ErrorKind.UNAVAILABLE
    code = "embed_timeout"


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as err:  # neither flavour installed
        raise MissingDependencyError(
            "onnxruntime is not installed: pip install 'dmlsearch[cpu]' (or 'dmlsearch[gpu]' for CUDA)"
        ) from err
    return onnxruntime


class Embedder:
    """An ONNX embedding model plus its ``model.json``: images in, L2-normalised float32 vectors out."""

    def __init__(
        self,
        model_path: Path | str,
        *,
        threads: int = 0,
        device: str = "auto",
        spinning: bool = False,
        run_seconds: float | None = None,
        card: ModelCard | None = None,
    ) -> None:
        """``run_seconds``: stop a model run that takes longer (:class:`EmbedTimeoutError`); None: no
        deadline (offline jobs, where a run's length is the job's). ``card``: the model's card where the
        caller read it already (``engine.model.bundle.locate_model``); None: read here."""
        self.model_path = Path(model_path)
        self.run_seconds = run_seconds
        if not self.model_path.exists():
            raise NotFoundError(f"model file {self.model_path} does not exist")
        self.card = card or ModelCard.load(self.model_path)
        check_fingerprint(self.model_path, self.card.fingerprint, self.model_path)
        self.sessions = ModelSession(self.model_path, threads=threads, device=device, spinning=spinning)
        self.session = self.sessions.session
        self.input_name = self.session.get_inputs()[0].name
        # The embeddings are the first output; an explainable model's feature map is a second one.
        self.output_name = self.session.get_outputs()[0].name

    @property
    def dim(self) -> int:
        return self.card.embedding_dim

    @property
    def fingerprint(self) -> str:
        return self.card.fingerprint

    def preprocess(self, images: Sequence[Image.Image]) -> np.ndarray:
        return to_tensor(images, self.card.preprocessing)

    def run_tensor(self, batch: np.ndarray) -> np.ndarray:
        """The model's raw output for a preprocessed NCHW batch; ``MemoryError`` when onnxruntime could not
        allocate (it raises its own ``Fail``, which the API would answer 500, not 503)."""
        (output,) = self._run(batch, [self.output_name])
        return output

    def embed_with_maps(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Embeddings (normalised as :meth:`embed_tensor`'s) and feature maps (n, c, h, w) of a preprocessed
        batch, in one run; only for a model whose card names an explainer (its graph has the maps)."""
        embeddings, maps = self._run(batch, [self.output_name, MAPS_OUTPUT])
        return normalize_rows(embeddings), maps

    def _run(self, batch: np.ndarray, outputs: list[str]) -> list[np.ndarray]:
        feed = {self.input_name: np.ascontiguousarray(batch, dtype=np.float32)}
        options = _onnxruntime().RunOptions()
        # onnxruntime checks the flag between kernels and stops the run: the only way to end one early.
        deadline = threading.Timer(self.run_seconds or 0.0, setattr, (options, "terminate", True))
        if self.run_seconds is not None:
            try:
                deadline.start()
            except RuntimeError as err:  # no room left to map its stack: the process is at its memory cap
                raise MemoryError(f"could not start the model run's deadline: {err}") from None
        try:
            return self.sessions.run(outputs, feed, options)
        except Exception as err:
            if options.terminate:
                raise EmbedTimeoutError(
                    f"the model did not embed {len(batch)} image(s) within {self.run_seconds:g} s"
                ) from None
            if ONNX_ALLOCATION_FAILED in str(err):
                raise MemoryError(f"the model could not allocate: {err}") from None
            raise
        finally:
            deadline.cancel()

    def embed_tensor(self, batch: np.ndarray, *, run_size: int | None = None) -> np.ndarray:
        """Run the model on a preprocessed NCHW batch; rows are L2-normalised (by ``normalize_rows``, the
        one place vectors are normalised: the index's own normalising then leaves them as they are).

        ``run_size``: at most this many images per model run. onnxruntime's memory arena grows to the
        activations of the largest run and keeps them, so this bounds what a big batch request costs.
        """
        if run_size is None or len(batch) <= run_size:
            return normalize_rows(self.run_tensor(batch))
        runs = [self.run_tensor(batch[start : start + run_size]) for start in range(0, len(batch), run_size)]
        return normalize_rows(np.concatenate(runs))

    def embed(self, images: Sequence[Image.Image]) -> np.ndarray:
        if not images:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.embed_tensor(self.preprocess(images))


class ModelSession:
    """An onnxruntime session whose runs for a request lowered into the background
    (``foundation.priority``) are lowered too: they run in a thread of their own at the lowest priority, in
    a second session with one intra-op thread (made at the first such run), so that the whole run is in
    that thread. The first session's thread pool serves every request: lowering one of its threads would
    lower them all."""

    def __init__(self, path: Path, *, threads: int = 0, device: str = "auto", spinning: bool = False) -> None:
        self.session = onnx_session(path, threads=threads, device=device, spinning=spinning)
        self._make_lowered = partial(onnx_session, path, threads=1, device=device, spinning=spinning)
        self._lowered: OnnxSession | None = None
        self._lowered_made = threading.Lock()

    def run(
        self, outputs: list[str] | None, feed: dict[str, np.ndarray], options: Any = None
    ) -> list[np.ndarray]:
        lower = lowering()
        if lower is None or not lower.is_set():
            return self.session.run(outputs, feed, options)
        with self._lowered_made:
            if self._lowered is None:
                self._lowered = self._make_lowered()
        return run_lowered(partial(self._lowered.run, outputs, feed, options))


def onnx_session(
    path: Path, *, threads: int = 0, device: str = "auto", spinning: bool = False
) -> OnnxSession:
    """An onnxruntime session with every graph optimisation; ``threads=0`` lets it use every core.

    ``spinning``: whether idle intra-op threads busy-wait for the next operator (onnxruntime's default).
    Off by default: the model always shares the cores with other work (build-index's decode threads, the
    server's request threads), and spinning threads burn the CPU time that work needs: the model took more
    CPU time per image with spinning than without (bench/results/build_speed.md).
    """
    ort = _onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    # int8 models: x86 CPUs without VNNI (AVX2 alone) run onnxruntime's u8s8 kernels through a saturating
    # 16-bit sum that broke the int8 export (mean cosine to fp32 0.89 instead of 0.99 on an AVX2 EPYC); this
    # makes them use exact u8u8 kernels there, and changes nothing on VNNI CPUs or for float models.
    options.add_session_config_entry("session.x64quantprecision", "1")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    require_regular(path)  # onnxruntime would wait on a FIFO for ever, or read a device without end
    return ort.InferenceSession(str(path), sess_options=options, providers=select_providers(device))


def select_providers(device: str = "auto") -> list[str]:
    """CUDA when asked for or available (onnxruntime-gpu with a GPU), else CPU."""
    available = _onnxruntime().get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise UnavailableError("device='cuda' requested but onnxruntime has no CUDAExecutionProvider")
    if "CUDAExecutionProvider" in available and device in ("auto", "cuda"):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]
