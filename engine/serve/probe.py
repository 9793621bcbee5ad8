"""A bundle proves it can answer before it is served: one probe query through its model and its index.

Loading checks a bundle's files (manifest, fingerprints, dimensions as declared); it cannot tell that a
model outputs 64 numbers while its card says 1280, outputs NaN, or loops for ever, nor that the vectors
in ``items.sqlite`` are garbage. :func:`prove_bundle` runs the model on a fixed image in a child process
that is killed when it overruns (a thread stuck inside onnxruntime cannot be stopped, and would hold a
core for good), checks the output's shape and values, searches the index with it and checks the stored
vectors. Run as ``python -m engine.serve.probe MODEL``, it is that child: it writes the model's raw output for
the probe image to stdout (``.npy``).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from engine.model.embedder import Embedder
from engine.serve.loaded_bundle import LoadedBundle
from foundation.errors import InvalidInputError
from index.gallery import GalleryIndex
from index.items import ItemStore
from index.protocol import normalize_rows, not_unit_rows

_PROBE_SIZE = 64
# Stored vectors read back from an index server (Milvus) by the probe.
_SAMPLED_VECTORS = 64
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The child's stderr kept for the error message: onnxruntime's last words, not a whole log.
_STDERR_TAIL = 400


class ProbeError(InvalidInputError):
    """The bundle failed its probe query: serving it would fail or hang searches."""

    code = "probe_failed"


def probe_image() -> Image.Image:
    """A fixed colour gradient: any model gives it a well-defined embedding."""
    ramp = np.linspace(0, 255, _PROBE_SIZE, dtype=np.float32)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], 255 - ramp[None, :]), axis=-1)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def probe_output(model_path: Path, timeout_s: float) -> np.ndarray:
    """The model's raw output for :func:`probe_image`, computed in a child process killed after
    ``timeout_s``; :class:`ProbeError` when it fails or overruns."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "engine.serve.probe", str(model_path)]
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:  # subprocess.run has killed the child
        raise ProbeError(f"the model did not embed one image within {timeout_s:g} s") from None
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip()[-_STDERR_TAIL:]
        raise ProbeError(f"the model failed on a probe image (exit {done.returncode}): {reason}")
    try:
        return np.load(io.BytesIO(done.stdout), allow_pickle=False)
    except ValueError as err:
        raise ProbeError(f"the probe process answered no array: {err}") from None


def check_output(output: np.ndarray, dim: int) -> np.ndarray:
    """The probe vector (L2-normalised) from the model's raw ``output``, if it is one finite, non-zero
    ``dim``-vector; else :class:`ProbeError`."""
    if output.shape != (1, dim):
        raise ProbeError(
            f"the model outputs shape {output.shape} for one image, but its card says {dim} dimensions"
        )
    if not np.isfinite(output).all():
        raise ProbeError("the model's output for a probe image is not finite (NaN or infinity)")
    if not np.linalg.norm(output) > 0:
        raise ProbeError("the model's output for a probe image is all zeros")
    return normalize_rows(output.astype(np.float32))


def check_index(bundle: LoadedBundle, vector: np.ndarray, *, stored_vectors: bool) -> None:
    """Search the bundle's index with ``vector``: a non-empty index must answer with finite scores. With
    ``stored_vectors``, also check every vector kept in ``items.sqlite`` (FAISS indexes)."""
    index = bundle.index
    if len(index):
        (hits,) = index.search(vector, 1)
        if not hits or not all(np.isfinite(hit.score) for hit in hits):
            raise ProbeError(f"the index answered a probe query with {hits!r}: it is damaged")
    if stored_vectors and isinstance(index.items, ItemStore):
        problem = index.items.vector_problem()
        if problem is not None:
            raise ProbeError(f"{index.directory / ItemStore.FILE_NAME}: {problem}")
    elif stored_vectors:
        check_sampled_vectors(index, bundle.embedder.dim)


def check_sampled_vectors(index: GalleryIndex, dim: int) -> None:
    """An index whose vectors live in its server (Milvus), where reading them all would take minutes at
    scale: as many vectors as items, and the vectors of the first items in id order are ``dim`` float32s,
    finite and of unit length; :class:`ProbeError` when not."""
    items, vectors = len(index.items), len(index)
    if items != vectors:
        raise ProbeError(f"the index holds {vectors} vectors for {items} items")
    ids = [item.id for item in index.items.page(0, _SAMPLED_VECTORS)]
    try:
        sample = index.vectors(ids)
    except KeyError as err:
        raise ProbeError(f"the index lost stored vectors: {err}") from None
    if sample.shape != (len(ids), dim):
        raise ProbeError(f"the stored vectors have shape {sample.shape[1:]}, the model {dim} dimensions")
    bad = not_unit_rows(sample)
    if bad.any():
        some = np.asarray(ids)[bad][:5].tolist()
        raise ProbeError(f"stored vectors of ids {some} are not finite unit vectors")


def prove_bundle(bundle: LoadedBundle, output: np.ndarray) -> None:
    """The probe of a bundle about to be served, from its model's ``output`` for the probe image
    (:func:`probe_output`, run before the model was loaded here); :class:`ProbeError` says what failed."""
    check_index(bundle, check_output(output, bundle.embedder.dim), stored_vectors=True)


def prove_index(bundle: LoadedBundle, *, stored_vectors: bool) -> None:
    """The probe of a bundle whose model is trusted to run in this process: the model served already,
    with another index, or the bundle a server starts with (nothing served yet; the model's run deadline
    stops one that never returns)."""
    embedder = bundle.embedder
    output = embedder.run_tensor(embedder.preprocess([probe_image()]))  # raw, as the child's: checked below
    check_index(bundle, check_output(np.asarray(output), embedder.dim), stored_vectors=stored_vectors)


def main() -> None:
    embedder = Embedder(Path(sys.argv[1]), threads=1)
    output = np.asarray(embedder.run_tensor(embedder.preprocess([probe_image()])))
    buffer = io.BytesIO()
    np.save(buffer, output, allow_pickle=False)
    sys.stdout.buffer.write(buffer.getvalue())


if __name__ == "__main__":
    main()
