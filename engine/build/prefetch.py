"""Load items (decode and preprocess image files, hash them) on worker threads while the model runs, so it
never waits for them.

Threads: hashlib, Pillow, numpy and onnxruntime release the GIL, so threads overlap on every core. The
build's decodes of gallery files go one step further, to the processes of ``engine.decode.pool`` (limits on
time and memory; the thread waits for its process); only the model input comes back. At most ``depth``
items are in flight (loaded or being loaded, not yet consumed): a bounded queue, so memory stays flat
however large the gallery and however slow the consumer.

The workers (threads, and the decode processes) run at a lower priority than the rest of the process
(``WORKER_NICENESS``): on as many cores as onnxruntime has intra-op threads, a decoding worker otherwise
preempts one of them, and the model's parallel regions wait for it. Lowered, the workers take the time the
model leaves: all of it while it waits for pixels (12-MP JPEGs), the gaps otherwise (224-px images).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from engine.decode.capture_time import capture_time, file_time
from engine.decode.images import ImageDecodeError, load_image_file, load_rgb, open_image
from engine.duplicates.signature import perceptual_signature
from engine.model.model_card import Preprocessing
from engine.model.preprocess import to_array
from foundation import defaults

T = TypeVar("T")
R = TypeVar("R")

# Added to the workers' niceness (at most 19). With it build-index was faster for 224-px images in every
# interleaved pair of runs, and within the runs' spread for 12-MP JPEGs
# (bench/results/build_speed_niceness.md).
WORKER_NICENESS = 10
MAX_NICENESS = 19
# Errors that mean "this file is not a usable image": the file is skipped and reported, the build goes on.
FILE_ERRORS = (ImageDecodeError, OSError)


@dataclass(frozen=True)
class DecodedFile:
    array: np.ndarray  # the model's input
    signature: bytes  # engine.duplicates.signature's perceptual signature
    taken: str  # when the photo was taken (engine.decode.capture_time)


def file_array(path: Path, preprocessing: Preprocessing) -> np.ndarray:
    """One image file as the model's normalised CHW input (large JPEGs decoded at a reduced DCT scale)."""
    return to_array(load_image_file(path, draft_size=preprocessing.resize_size), preprocessing)


def decode_file(path: Path, preprocessing: Preprocessing) -> DecodedFile:
    """What indexing needs of one image file, from one decode: the model's input, the signature and when
    the photo was taken (from the header, before decoding: a converted image may drop its EXIF)."""
    header = open_image(path.read_bytes(), draft_size=preprocessing.resize_size)
    taken = capture_time(header) or file_time(path)
    image = load_rgb(header)
    return DecodedFile(to_array(image, preprocessing), perceptual_signature(image), taken)


def prefetch(
    items: Iterable[T], load: Callable[[T], R], *, workers: int = defaults.DECODE_WORKERS, depth: int
) -> Iterator[tuple[T, R | Exception]]:
    """``(item, load(item))`` in the order of ``items``, loaded by ``workers`` threads up to ``depth`` ahead.

    A load that raises one of :data:`FILE_ERRORS` yields the exception in place of its result; any other
    exception propagates. ``workers=0`` loads on the calling thread (no overlap).
    """
    if workers == 0:
        for item in items:
            yield item, _attempt(load, item)
        return
    pending: deque[tuple[T, Future[R | Exception]]] = deque()
    with ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix="decode", initializer=_lower_priority
    ) as pool:
        try:
            for item in items:
                pending.append((item, pool.submit(_attempt, load, item)))
                if len(pending) >= depth:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        finally:  # the consumer stopped early (an error, a closed generator): drop what is queued
            for _, future in pending:
                future.cancel()


def _lower_priority() -> None:
    """Raise the calling thread's niceness by ``WORKER_NICENESS`` (Linux schedules threads one by one;
    elsewhere niceness is the whole process's, so it is left alone)."""
    if sys.platform == "linux":
        thread = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(MAX_NICENESS, niceness + WORKER_NICENESS))


def _attempt(load: Callable[[T], R], item: T) -> R | Exception:
    try:
        return load(item)
    except FILE_ERRORS as err:
        return err
