"""The pretrained backbone, its ONNX export and the onnxruntime embedder."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.model.embedder import Embedder
from engine.model.model_card import ModelCard
from engine.model.preprocess import to_tensor
from foundation.priority import LOWERED_NICENESS, lowered_by
from training.backbone import BACKBONES, create_backbone
from training.model import EmbeddingModel

PREPROCESSING = BACKBONES["efficientnet_lite0"].preprocessing


def test_pretrained_backbone_predicts_imagenet_classes() -> None:
    """The package's weights, mapped by position into timm's model, classify bundled photos correctly."""
    import skimage.data

    classifier = create_backbone("efficientnet_lite0", with_classifier=True)
    photos = {"chelsea": skimage.data.chelsea(), "coffee": skimage.data.coffee()}
    batch = torch.from_numpy(to_tensor([Image.fromarray(p) for p in photos.values()], PREPROCESSING))
    with torch.no_grad():
        top5 = classifier(batch).topk(5).indices.tolist()
    cats = {281, 282, 283, 284, 285}  # tabby, tiger cat, Persian, Siamese, Egyptian cat
    assert top5[0][0] in cats, top5[0]
    assert top5[1][0] in {967, 968}, top5[1]  # espresso, cup


@pytest.mark.parametrize("batch_size", [1, 7])
def test_onnx_export_matches_torch(exported_model: Path, batch_size: int) -> None:
    torch.manual_seed(batch_size)
    images = torch.randn(batch_size, 3, 224, 224)
    model = EmbeddingModel(create_backbone("efficientnet_lite0")).eval()
    with torch.no_grad():
        expected = model(images).numpy()
    actual = Embedder(exported_model, threads=1).embed_tensor(images.numpy())
    assert actual.shape == (batch_size, 1280)
    assert np.abs(actual - expected).max() <= 1e-4


def test_model_card_describes_the_export(exported_model: Path) -> None:
    card = ModelCard.load(exported_model)
    assert card.embedding_dim == 1280
    assert card.preprocessing.input_size == 224
    assert card.backbone == "efficientnet_lite0"
    assert len(card.fingerprint) == 64


def test_embeddings_are_unit_float32_and_batch_independent(exported_model: Path) -> None:
    from bench.lib.images import make_image

    embedder = Embedder(exported_model, threads=1)
    images = [make_image(seed, size=(120 + seed, 90)) for seed in range(5)]
    together = embedder.embed(images)
    alone = np.concatenate([embedder.embed([image]) for image in images])
    assert together.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_tampered_model_is_refused(exported_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model.onnx"
    copy.write_bytes(exported_model.read_bytes() + b"\0")
    ModelCard.path_for(copy).write_text(ModelCard.path_for(exported_model).read_text())
    with pytest.raises(ValueError, match=r"does not match its model\.json"):
        Embedder(copy)


# A model run whose deadline thread cannot start, in a process at its address-space cap.
_CAPPED_RUN = """
import resource, sys
from pathlib import Path
from PIL import Image
from engine.model.embedder import Embedder

embedder = Embedder(sys.argv[1], threads=1)
batch = embedder.preprocess([Image.new("RGB", (32, 32))])
embedder.run_tensor(batch)  # onnxruntime's arena grown to this run: the next one allocates nothing
size = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
_, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (size + 4 * 1024**2, hard))  # less than a thread's stack
embedder.run_seconds = 60.0
try:
    embedder.run_tensor(batch)
except MemoryError as err:
    print("MemoryError:", err)
"""


def test_a_run_whose_deadline_cannot_start_is_out_of_memory(small_model: Path) -> None:
    """Before, ``RuntimeError: can't start new thread``: a 500 where the server was at its memory cap, not
    the 503 ``out_of_memory`` of its model's own allocation failures (seen in tests/app/test_faults.py,
    test_running_out_of_memory_is_a_503_and_the_memory_comes_back, in 3 of 7 runs)."""
    done = subprocess.run(
        [sys.executable, "-c", _CAPPED_RUN, str(small_model)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "MemoryError: could not start the model run's deadline" in done.stdout


def _threads_at(niceness: int) -> dict[int, int]:
    """This process's threads at ``niceness``: native id -> CPU ticks used (``/proc/self/task/*/stat``)."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()  # from field 3, the state
        except OSError:  # the thread ended meanwhile
            continue
        if int(fields[16]) == niceness:  # field 19: nice; 14 and 15: utime, stime
            found[int(task.name)] = int(fields[11]) + int(fields[12])
    return found


def test_the_model_run_of_a_lowered_request_runs_at_the_lowest_priority(exported_model: Path) -> None:
    """Issue 43, leftover: a request moved to the background had its decodes lowered, but its model run
    went on at the server's priority in onnxruntime's threads, shared by every request (a batch of 64 cheap
    images cost a normal search the cores). Now a lowered request's runs are in a thread of its own at
    niceness 19, in a session with one intra-op thread, and the calling thread keeps its priority."""
    embedder = Embedder(exported_model, threads=2)
    images = [Image.fromarray(np.full((96, 96, 3), i * 9, dtype=np.uint8)) for i in range(24)]
    batch = embedder.preprocess(images)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert caller < LOWERED_NICENESS, "run these tests below niceness 19"
    seen: dict[int, int] = {}
    running = threading.Event()

    def watch() -> None:
        while running.is_set():
            seen.update(_threads_at(LOWERED_NICENESS))
            time.sleep(0.005)

    lowered = threading.Event()
    lowered.set()
    running.set()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with lowered_by(lowered):
            found = [embedder.run_tensor(batch) for _ in range(3)]
    finally:
        running.clear()
        watcher.join()
    assert seen and max(seen.values()) > 0, seen  # before: no thread of the process at 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    assert not _threads_at(LOWERED_NICENESS)  # the lowered thread ended with its run
    for output in found:
        np.testing.assert_allclose(output, embedder.run_tensor(batch), rtol=1e-4, atol=1e-5)
