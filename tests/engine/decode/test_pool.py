"""The decode processes (engine.decode.pool): real worker processes, real limits, hostile files made here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.lib.cluster import group_alive
from bench.lib.hostile_images import LEGIT, jpeg_repeated_scan
from bench.lib.images import image_bytes, make_image
from engine.decode.images import ImageDecodeError, thumbnail_jpeg
from engine.decode.model_input import DecodedUploads, PixelBudget, decode_uploads
from engine.decode.pool import (
    DecodeCancelledError,
    DecodeLimits,
    DecodePool,
    DecodePoolClosedError,
    cancelled_by,
)
from engine.model.model_card import Preprocessing
from foundation.priority import lowered_by
from foundation.regular_files import FileTooLargeError, NotRegularFileError
from tests.support.decoding import imported
from tests.support.waiting import wait_until

BUDGET = PixelBudget(draft_size=224)
# A CPU limit the repeated scans pass by far, and a wall limit they never reach in these tests.
LIMITS = DecodeLimits(cpu_seconds=1, wall_seconds=120, memory_bytes=300 * 1024**2)


@pytest.fixture(scope="module")
def pool() -> Iterator[DecodePool]:
    with DecodePool(1, LIMITS) as started:
        yield started


@pytest.fixture(scope="module")
def scans() -> bytes:
    return jpeg_repeated_scan(1000)


def decode(pool: DecodePool, data: bytes) -> DecodedUploads:
    return pool.run(decode_uploads, [data], BUDGET, Preprocessing())


def worker_pids(pool: DecodePool) -> set[int]:
    return {worker.process.pid for worker in pool._live}


def test_an_image_decodes_to_the_model_input_through_shared_memory(pool: DecodePool) -> None:
    decoded = decode(pool, image_bytes(make_image(1)))
    assert decoded.tensor.shape == (1, 3, 224, 224)
    assert decoded.tensor.flags.writeable  # copied out of the shared block, which the next task reuses
    assert decoded.formats == ["PNG"]


def shared_memory_resident() -> int:
    """Bytes of shared memory resident in this process (``RssShmem``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise KeyError("RssShmem")


def test_an_answer_copied_out_leaves_nothing_resident_in_the_shared_memory() -> None:
    """Before, each worker's shared memory kept its last answer, resident in the caller too: a server grew
    by a batch's model input (11 MB) for each worker of its pool in turn (tests/app/test_faults.py,
    test_running_out_of_memory_is_a_503_and_the_memory_comes_back: 34 MB over 3 batches on 4 workers)."""
    with DecodePool(2) as two:
        before = shared_memory_resident()
        for _ in range(4):  # each worker twice
            assert two.run(np.ones, 3 * 1024**2, dtype=np.float32).nbytes == 12 * 1024**2
        assert shared_memory_resident() - before < 1024**2


def test_a_fresh_worker_starts_with_what_a_perceptual_signature_imports() -> None:
    """imagehash imports scipy.fftpack at its first hash: before, the first ``add`` in each fresh worker
    took 0.8 s idle, 2.3-3 s on a loaded machine, and 20 reloads saw 4-8 adds where 30-39 now run
    (tests/app/test_faults.py, test_reloads_during_writes_keep_every_acknowledged_write)."""
    with DecodePool(1) as fresh:
        assert fresh.run(imported, "scipy.fftpack")


def test_a_corrupt_image_keeps_its_worker(pool: DecodePool) -> None:
    before = worker_pids(pool)
    with pytest.raises(ImageDecodeError) as refused:
        decode(pool, image_bytes(make_image(2))[:300])
    assert refused.value.code == "corrupt_image"
    assert worker_pids(pool) == before


def test_cpu_over_the_limit_ends_the_worker_and_a_fresh_one_serves(pool: DecodePool, scans: bytes) -> None:
    before = worker_pids(pool)
    with pytest.raises(ImageDecodeError, match="s of CPU") as refused:
        decode(pool, scans)
    assert refused.value.code == "image_too_costly"
    assert worker_pids(pool).isdisjoint(before)
    assert decode(pool, image_bytes(make_image(3))).tensor.shape == (1, 3, 224, 224)


def test_memory_over_the_limit_is_too_costly_not_corrupt(pool: DecodePool) -> None:
    """libwebp reports the failed allocation as "could not create decoder object"."""
    with pytest.raises(ImageDecodeError, match="300 MB") as refused:
        decode(pool, LEGIT["webp-lossless-RGBA-49mp"]())
    assert refused.value.code == "image_too_costly"


@pytest.fixture(scope="module")
def costly() -> bytes:
    """A JPEG that costs about a second of CPU here: under one image's limit, not many at once."""
    return jpeg_repeated_scan(20)


def batch_of(costly: bytes, cheap: int = 2, count: int = 6) -> list[bytes]:
    return [image_bytes(make_image(seed)) for seed in range(cheap)] + [costly] * count


def test_a_batch_over_the_request_cpu_budget_is_cut_off_at_the_image_that_spent_it(costly: bytes) -> None:
    """Hostile (issue 43, class 2): 64 images each under one image's limits held a decode process for 64
    times that limit (164 s of CPU for one request). Each image here is well under its own limit."""
    limits = DecodeLimits(cpu_seconds=30, wall_seconds=600, request_cpu_seconds=2, request_wall_seconds=600)
    with DecodePool(1, limits) as pool:
        images = batch_of(costly)
        with pytest.raises(ImageDecodeError, match=r"^image [2-7]: .*2 s of CPU in all") as refused:
            pool.run(decode_uploads, images, BUDGET, Preprocessing(), images=len(images))
        assert refused.value.code == "request_too_costly"
        assert refused.value.kind.value == "invalid"  # a 4xx: the request's cost, not the server's state
        # The budget is the request's, not the worker's: the next request has all of it.
        two = batch_of(costly, count=1)
        assert pool.run(decode_uploads, two, BUDGET, Preprocessing(), images=3).tensor.shape[0] == 3


def test_a_batch_over_the_request_wall_budget_is_cut_off_naming_its_image(costly: bytes) -> None:
    limits = DecodeLimits(cpu_seconds=30, wall_seconds=600, request_cpu_seconds=600, request_wall_seconds=1.5)
    with DecodePool(1, limits) as pool:
        images = batch_of(costly)
        with pytest.raises(ImageDecodeError, match=r"^image [2-7]: .*longer than 1.5 s in all") as refused:
            pool.run(decode_uploads, images, BUDGET, Preprocessing(), images=len(images))
        assert refused.value.code == "request_too_costly"


def test_one_image_over_its_own_limit_in_a_batch_is_named_and_gets_no_more_than_one_image_s_limit(
    scans: bytes,
) -> None:
    """A batch of 8 got 8 times one image's CPU for any one of them, and the error did not say which."""
    limits = DecodeLimits(cpu_seconds=1, wall_seconds=600, request_cpu_seconds=600, request_wall_seconds=600)
    with DecodePool(1, limits) as pool:
        images = [*batch_of(scans, cheap=3, count=1), *batch_of(scans, cheap=4, count=0)]
        with pytest.raises(
            ImageDecodeError, match=r"^image 3: .*1 s of CPU, the limit for one image"
        ) as refused:
            pool.run(decode_uploads, images, BUDGET, Preprocessing(), images=len(images))
        assert refused.value.code == "image_too_costly"


def test_one_image_over_its_wall_limit_in_a_batch_is_named(scans: bytes) -> None:
    limits = DecodeLimits(cpu_seconds=600, wall_seconds=1, request_cpu_seconds=600, request_wall_seconds=600)
    with DecodePool(1, limits) as pool:
        images = [*batch_of(scans, cheap=2, count=1), image_bytes(make_image(9))]
        with pytest.raises(ImageDecodeError, match=r"^image 2: .*longer than 1 s, the limit for one image"):
            pool.run(decode_uploads, images, BUDGET, Preprocessing(), images=len(images))


def test_a_cancelled_decode_stops_at_once(scans: bytes) -> None:
    patient = DecodeLimits(cpu_seconds=600, wall_seconds=600)
    with DecodePool(1, patient) as pool:
        gone = threading.Event()
        threading.Timer(1.0, gone.set).start()
        started = time.monotonic()
        with cancelled_by(gone), pytest.raises(DecodeCancelledError):
            decode(pool, scans)
        assert time.monotonic() - started < 5
        assert decode(pool, image_bytes(make_image(4))).tensor.shape == (1, 3, 224, 224)


def test_a_lowered_decode_runs_at_the_lowest_priority_and_its_worker_is_replaced() -> None:
    """Fairness between clients (issue 43, class 2): a request that held its compute slot long while another
    client waited goes on in the background, its decodes at niceness 19; a worker cannot raise its priority
    again, so the next task gets a fresh one at the usual priority."""
    lowered = threading.Event()
    lowered.set()
    with DecodePool(1) as pool:
        before = worker_pids(pool)
        with lowered_by(lowered):
            assert pool.run(os.getpriority, os.PRIO_PROCESS, 0) == 19
        assert worker_pids(pool).isdisjoint(before)
        assert pool.run(os.getpriority, os.PRIO_PROCESS, 0) == os.getpriority(os.PRIO_PROCESS, 0)


def test_a_decode_under_way_is_lowered_midway(scans: bytes) -> None:
    lowered = threading.Event()
    patient = DecodeLimits(cpu_seconds=600, wall_seconds=600)
    with DecodePool(1, patient) as pool:
        (pid,) = worker_pids(pool)
        gone = threading.Event()

        def decode_lowered() -> None:
            with lowered_by(lowered), cancelled_by(gone), pytest.raises(DecodeCancelledError):
                decode(pool, scans)

        decoding = threading.Thread(target=decode_lowered)
        decoding.start()
        time.sleep(0.5)
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)  # not yet
        lowered.set()
        wait_until(lambda: os.getpriority(os.PRIO_PROCESS, pid) == 19, 5, "the decode under way lowered")
        gone.set()
        decoding.join()


def test_a_worker_killed_while_idle_is_replaced_before_it_takes_a_task() -> None:
    """The kernel's OOM killer may end an idle worker; the next decode gets a fresh one, not a 503 (seen
    with four workers per server: the fault test killed every worker, and the next search took a dead idle
    one)."""
    with DecodePool(2) as pool:
        for pid in worker_pids(pool):
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: all(not worker.process.is_alive() for worker in pool._live), 10, "the kills")
        assert pool.run(len, b"abc") == 3
        assert pool.run(len, b"abcd") == 4


def test_closing_the_pool_ends_a_decode_in_flight(scans: bytes) -> None:
    pool = DecodePool(1, DecodeLimits(cpu_seconds=600, wall_seconds=600))
    threading.Timer(1.0, pool.close).start()
    started = time.monotonic()
    with pytest.raises(DecodePoolClosedError):
        decode(pool, scans)
    assert time.monotonic() - started < 5


def test_a_process_that_never_closes_its_pool_still_exits() -> None:
    """At exit, multiprocessing ends a pool's daemon workers with SIGTERM and waits for them: a worker
    ignoring SIGTERM (one session's attempt to survive a process group's stop) hung the exit forever."""
    script = "from engine.decode.pool import DecodePool; print(DecodePool(1).run(len, b'abc'))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "3", done.stderr


def test_a_stop_of_the_whole_process_group_lets_the_decodes_under_way_finish() -> None:
    """systemd's stop and ``kill -- -PGID`` signal the workers and their forkserver too: the owner (a server
    draining its requests, a build finishing its batch) must still get the answers of decodes under way. The
    forkserver's death alone made every worker look dead ("the decoder crashed", exit code 255)."""
    script = (
        "import signal, time\n"
        "from engine.decode.pool import DecodePool\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('stopping', flush=True))  # finish, then exit\n"
        "with DecodePool(1) as pool:\n"
        "    print('started', flush=True)\n"
        "    pool.run(time.sleep, 3)\n"
        "    print('finished', flush=True)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert process.stdout.readline().strip() == "started"
    time.sleep(1)  # the worker is in its task
    os.killpg(process.pid, signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert output.split() == ["stopping", "finished"], output
    # The workers and the forkserver end with their owner (the forkserver once it sees its owner gone).
    wait_until(lambda: not group_alive(process.pid, process), 30, "the owner's processes to end")


# Gallery files are read by the decode process itself (issue 43, class 4): the regular-file rules hold
# there, and their refusals cross back to the caller as themselves, not as a crash or a corrupt image.


def test_a_gallery_path_that_became_a_fifo_is_refused_at_once_in_the_worker(
    pool: DecodePool, tmp_path: Path
) -> None:
    """Hostile: a file swapped for a FIFO after the server's check would hold the worker until its wall
    limit (120 s here) if it were opened blocking."""
    os.mkfifo(tmp_path / "swapped.jpg")
    started = time.monotonic()
    with pytest.raises(NotRegularFileError, match="FIFO"):
        pool.run(thumbnail_jpeg, tmp_path / "swapped.jpg", 64)
    assert time.monotonic() - started < 10


def test_a_gallery_file_over_the_file_limit_is_refused_unread(pool: DecodePool, tmp_path: Path) -> None:
    """Hostile: a sparse 600 MB "JPEG" (a header, then a hole) costs no disk; read whole it would take 600
    MB. Before class 4 the server read such files itself (a 600 MB JPEG with trailing data answered 400
    corrupt_image, the server at 2.0 GB)."""
    path = tmp_path / "sparse.jpg"
    path.write_bytes(image_bytes(make_image(2), "JPEG"))
    os.truncate(path, 600 * 1024**2)
    with pytest.raises(FileTooLargeError):
        pool.run(decode_uploads, [path], BUDGET, Preprocessing())


def test_a_gallery_file_decodes_to_the_model_input_by_its_path(pool: DecodePool, tmp_path: Path) -> None:
    data = image_bytes(make_image(3))
    (tmp_path / "item.png").write_bytes(data)
    by_path = pool.run(decode_uploads, [tmp_path / "item.png", data], BUDGET, Preprocessing())
    assert (by_path.tensor[0] == by_path.tensor[1]).all()
