"""build-index throughput against the model alone: is the model ever idle waiting for pixels?

    python bench/build_speed.py --data CARS196/images [--work ~/.cache/dmlsearch/ingest]
                                [--count 2000] [--large-count 200] [--workers 0 1 2 3] [--threads 0]
                                [--niceness 0 10] [--repeats 4]

In one run, on one model (the pretrained export, or ``--model``):
- model only: onnxruntime at ``--batch-size`` on pre-decoded tensors (``--threads`` intra-op threads), with
  and without spinning threads (``engine.model.embedder.onnx_session``); the faster of the two is the
  reference;
- decode only: the decode pool alone (read, decode, resize, crop, normalise, perceptual signature), per
  worker count;
- end to end: ``engine.build.indexing.build_index`` into a fresh index (hashing, decoding, embedding, adding,
  building) on ``--count`` Cars196 images (224 px, the first in sorted path order) and on ``--large-count``
  12-MP JPEGs generated from them (upscaled to 4000x3000, quality 92, cached under ``--work``), per
  decode-worker count (0 = decoding on the calling thread, as build-index did before the pool) and
  ``--niceness`` of the workers (``engine.build.prefetch.WORKER_NICENESS``), ``--repeats`` times, interleaved.
Each end-to-end rate is divided by the mean of the model-only rates measured right before and right after
it, so that load drifting on a shared machine moves both sides of a ratio alike. Files are read once before
timing, so every run reads them from the page cache. The load average is recorded at the start and the end;
results go to ``--out``.{md,json}.

The cost split says what ratio the cores allow. Decode and model share the same cores, so build-index can
at best turn every CPU-second into either model work, at its cheapest (one intra-op thread: no
synchronisation), or decoding; the model alone turns its CPU time (all threads, spinning included) into
images. Hence, per image in CPU-ms (``time.process_time``, one thread, ``--split-count`` files):
``bound = model CPU of the reference / (model CPU at 1 thread + hash + decode + preprocess + signature)``,
the best ratio reachable whatever the pipeline, when the model alone keeps every core busy.
``floor`` is the same with only the hash (content identity) and a decode at the smallest DCT scale libjpeg
has, 1/8 (one pixel a block: no inverse DCT to speak of, no resize, no signature): a baseline JPEG's
entropy-coded data must be decoded in full whatever size is wanted from it, so no decoder, pipeline or
quality given up reaches a higher ratio on these cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from lib.options import bench_parser, data_option, model_option, out_option, threads_option
from PIL import Image
from tqdm import tqdm

from engine.build import prefetch as prefetch_module
from engine.build.indexing import build_index
from engine.build.prefetch import decode_file, prefetch
from engine.decode.images import load_image_file
from engine.duplicates.signature import perceptual_signature
from engine.gallery.files import list_images
from engine.gallery.hashing import file_hash
from engine.model.embedder import Embedder
from engine.model.preprocess import to_array
from foundation import defaults
from foundation.atomic import atomic_write_text
from foundation.defaults import BACKBONE
from training.features import backbone_model

LARGE_SIZE = (4000, 3000)
LARGE_QUALITY = 92


def small_folder(data: Path, count: int, work: Path) -> Path:
    """The first ``count`` images of ``data`` copied under ``work`` (same labels, same bytes; copies, as
    build-index skips links that lead outside the gallery)."""
    folder = work / f"small_{count}_copies"
    if not folder.exists():
        staging = work / f".{folder.name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        for path in list_images(data)[:count]:
            target = staging / path.relative_to(data)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        staging.rename(folder)
    return folder


def positive(text: str) -> int:
    """An argparse type: both folders are timed, so a count of 0 is an error, not an empty row."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def large_folder(data: Path, count: int, work: Path) -> Path:
    """The first ``count`` images of ``data`` upscaled to 12 MP and saved as a camera would (JPEG q92)."""
    folder = work / f"large_{count}_{LARGE_SIZE[0]}x{LARGE_SIZE[1]}_q{LARGE_QUALITY}"
    if not folder.exists():
        staging = work / f".{folder.name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        for path in tqdm(list_images(data)[:count], desc="generating 12-MP JPEGs", unit="img"):
            target = (staging / path.relative_to(data)).with_suffix(".jpg")
            target.parent.mkdir(parents=True, exist_ok=True)
            image = Image.open(path).convert("RGB").resize(LARGE_SIZE, Image.Resampling.BICUBIC)
            image.save(target, format="JPEG", quality=LARGE_QUALITY)
        staging.rename(folder)
    return folder


def model_only(embedder: Embedder, batch_size: int, batches: int) -> tuple[float, float]:
    """Images per second and CPU-ms per image of onnxruntime alone on ``batches`` pre-decoded batches
    (after one warm-up)."""
    config = embedder.card.preprocessing
    batch = np.random.default_rng(0).standard_normal((batch_size, 3, config.input_size, config.input_size))
    batch = batch.astype(np.float32)
    embedder.embed_tensor(batch)
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(batches):
        embedder.embed_tensor(batch)
    images = batches * batch_size
    return images / (time.perf_counter() - started), 1000 * (time.process_time() - cpu_started) / images


def cpu_ms_per_file(files: list[Path], work: Callable[[Path], object]) -> float:
    """CPU-ms per file of ``work`` on the calling thread."""
    started = time.process_time()
    for path in files:
        work(path)
    return 1000 * (time.process_time() - started) / len(files)


def smallest_decode(path: Path) -> None:
    """Decode ``path`` at the smallest scale its decoder offers (1/8 for a JPEG, in full otherwise)."""
    with Image.open(path) as image:
        image.draft("RGB", (1, 1))
        image.load()


def best_ratio(model_cpu: dict[str, float], *stages_ms: float) -> float:
    """The ratio the cores allow when each image costs ``stages_ms`` besides the model (module docstring)."""
    return min(1.0, model_cpu["spin"] / (model_cpu["one_thread"] + sum(stages_ms)))


def cost_split(files: list[Path], embedder: Embedder) -> dict[str, float | str]:
    """CPU-ms per image of each stage build-index runs on a file besides the model (one thread)."""
    config = embedder.card.preprocessing
    decoded = [load_image_file(path, draft_size=config.resize_size) for path in files]
    # Warm-up, untimed: first calls set up (the first signature imports scipy's DCT, ~2 ms a 224-px image).
    to_array(decoded[0], config)
    perceptual_signature(decoded[0])
    started = time.process_time()
    for image in decoded:
        to_array(image, config)
    preprocess_cpu_ms = 1000 * (time.process_time() - started) / len(files)
    started = time.process_time()
    for image in decoded:
        perceptual_signature(image)
    signature_cpu_ms = 1000 * (time.process_time() - started) / len(files)
    return {
        "hash_cpu_ms": cpu_ms_per_file(files, file_hash),
        "decode_cpu_ms": cpu_ms_per_file(files, lambda p: load_image_file(p, draft_size=config.resize_size)),
        "preprocess_cpu_ms": preprocess_cpu_ms,
        "signature_cpu_ms": signature_cpu_ms,
        "decoded_size": "x".join(map(str, decoded[0].size)),
        "smallest_decode_cpu_ms": cpu_ms_per_file(files, smallest_decode),
    }


def decode_only_rate(files: list[Path], embedder: Embedder, workers: int, batch_size: int) -> float:
    config = embedder.card.preprocessing
    started = time.perf_counter()
    for _, result in prefetch(files, lambda p: decode_file(p, config), workers=workers, depth=2 * batch_size):
        assert not isinstance(result, Exception), result
    return len(files) / (time.perf_counter() - started)


def build_rate(
    folder: Path, embedder: Embedder, out: Path, workers: int, batch_size: int
) -> tuple[float, float]:
    """Images per second and CPU-ms per image (all threads) of build-index into a fresh index."""
    shutil.rmtree(out, ignore_errors=True)
    started, cpu_started = time.perf_counter(), time.process_time()
    report = build_index(folder, embedder, out, batch_size=batch_size, progress=False, decode_workers=workers)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    assert not report.skipped, report.skipped
    shutil.rmtree(out)
    return report.indexed / seconds, 1000 * cpu_seconds / report.indexed


def bracketed(
    measure: Callable[[], tuple[float, float]], model_rates: Callable[[], dict[str, float]]
) -> dict[str, float]:
    """``measure()`` between two model-only measurements, and its ratio to the mean of the faster one."""
    before = model_rates()
    rate, cpu_ms = measure()
    after = model_rates()
    means = {name: (before[name] + after[name]) / 2 for name in before}
    model = max(means.values())
    return {
        "img_per_s": rate,
        "cpu_ms_per_img": cpu_ms,
        **means,
        "model_img_per_s": model,
        "ratio": rate / model,
    }


def main() -> None:
    parser = bench_parser(
        __doc__,
        data_option("Folder of 224-px images (Cars196)."),
        model_option("model.onnx (default: the pretrained export)."),
        threads_option(0, help="onnxruntime intra-op threads (0 = all)."),
        out_option(Path("bench/results/build_speed")),
    )
    parser.add_argument(
        "--work", type=Path, default=defaults.CACHE_DIR / "ingest", help="Cache for the generated files."
    )
    parser.add_argument("--count", type=positive, default=2000, help="224-px images built end to end.")
    parser.add_argument("--large-count", type=positive, default=200, help="12-MP JPEGs built end to end.")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, defaults.DECODE_WORKERS])
    parser.add_argument(
        "--niceness",
        type=int,
        nargs="+",
        default=[prefetch_module.WORKER_NICENESS],
        help="niceness added to the decode workers (engine/build/prefetch.py), each measured",
    )
    parser.add_argument("--repeats", type=int, default=1, help="end-to-end runs of each setting, interleaved")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model-batches", type=int, default=10, help="Batches per model-only timing.")
    parser.add_argument(
        "--split-count", type=int, default=100, help="Files per folder timed for the cost split."
    )
    args = parser.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    model = args.model or backbone_model(args.work, BACKBONE)
    embedder = Embedder(model, threads=args.threads)  # as build-index runs it (no spinning)
    sessions = {"no_spin": embedder, "spin": Embedder(model, threads=args.threads, spinning=True)}
    folders = {
        "224px": small_folder(args.data, args.count, args.work),
        "12MP": large_folder(args.data, args.large_count, args.work),
    }
    for folder in folders.values():  # into the page cache: every timed run reads from memory
        for path in list_images(folder):
            path.read_bytes()

    def model_rates() -> dict[str, float]:
        return {
            f"model_{name}_img_per_s": model_only(session, args.batch_size, args.model_batches)[0]
            for name, session in sessions.items()
        }

    model_cpu = {
        name: model_only(session, args.batch_size, args.model_batches)[1]
        for name, session in {**sessions, "one_thread": Embedder(model, threads=1)}.items()
    }
    print("model CPU-ms/img: " + ", ".join(f"{name} {ms:.1f}" for name, ms in model_cpu.items()))
    splits = {}
    for name, folder in folders.items():
        split = cost_split(list_images(folder)[: args.split_count], embedder)
        stages = ("hash", "decode", "preprocess", "signature")
        split["bound"] = best_ratio(model_cpu, *(split[f"{stage}_cpu_ms"] for stage in stages))
        split["floor"] = best_ratio(model_cpu, split["hash_cpu_ms"], split["smallest_decode_cpu_ms"])
        splits[name] = split
        print(f"{name} CPU-ms/img: {split}")

    rows = []
    for name, folder in folders.items():
        files = list_images(folder)
        runs = [(n, w) for _ in range(args.repeats) for n in args.niceness for w in args.workers]
        for niceness, workers in runs:  # repeats interleaved, so that drifting load moves every setting alike
            prefetch_module.WORKER_NICENESS = niceness
            decode = decode_only_rate(files, embedder, workers, args.batch_size)
            row = bracketed(
                lambda f=folder, w=workers: build_rate(f, embedder, args.work / "index", w, args.batch_size),
                model_rates,
            )
            row.update(images=name, files=len(files), workers=workers, niceness=niceness)
            row["decode_only_img_per_s"] = decode
            rows.append(row)
            print(
                f"{name:>6} workers={workers} niceness={niceness}: build-index {row['img_per_s']:.1f} "
                f"img/s = {row['ratio']:.2f}x model ({row['model_img_per_s']:.1f} img/s); "
                f"{row['cpu_ms_per_img']:.1f} CPU-ms/img; decode alone {decode:.1f} img/s"
            )
    load_end = os.getloadavg()
    command = "python " + shlex.join(sys.argv)
    meta = {
        "command": command,
        "batch_size": args.batch_size,
        "onnxruntime_threads": args.threads,
        "cpu_count": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": load_end,
        "large_images": f"{LARGE_SIZE[0]}x{LARGE_SIZE[1]} JPEG q{LARGE_QUALITY}, upscaled from --data",
        "model_cpu_ms_per_img": model_cpu,
        "cost_split": splits,
    }
    result = {"meta": meta, "rows": rows}
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(result, indent=2))
    atomic_write_text(args.out.with_suffix(".md"), report_markdown(result, args.threads))


def report_markdown(result: dict, threads: int) -> str:
    meta, rows = result["meta"], result["rows"]
    model_cpu = meta["model_cpu_ms_per_img"]
    loads = {when: ", ".join(f"{v:.2f}" for v in meta[f"load_average_{when}"]) for when in ("start", "end")}
    lines = [
        "# build-index throughput vs the model alone",
        "",
        f"`{meta['command']}`",
        "",
        f"onnxruntime batch {meta['batch_size']}, {threads or 'all'} intra-op threads, "
        f"{meta['cpu_count']} cores; load average (1, 5, 15 min) at start {loads['start']}, "
        f"at end {loads['end']}.",
        "Ratio = build-index img/s over the mean of the model-only img/s measured just before and after it "
        "(the faster of onnxruntime with spinning threads and without; build-index runs without).",
        "",
        "| images | files | workers | niceness | build-index img/s | build-index CPU-ms/img "
        "| model-only img/s (spin / no spin) | ratio | decode only img/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['images']} | {r['files']} | {r['workers']} | {r['niceness']} | {r['img_per_s']:.1f} | "
        f"{r['cpu_ms_per_img']:.1f} | "
        f"{r['model_spin_img_per_s']:.1f} / {r['model_no_spin_img_per_s']:.1f} | {r['ratio']:.2f}x | "
        f"{r['decode_only_img_per_s']:.1f} |"
        for r in rows
    ]
    lines += [
        "",
        "## Cost split (CPU-ms per image, one thread)",
        "",
        f"Model at batch {meta['batch_size']}: {model_cpu['spin']:.1f} with spinning threads, "
        f"{model_cpu['no_spin']:.1f} without, {model_cpu['one_thread']:.1f} on one thread. "
        "Bound: the best ratio the cores allow (see the module docstring). Floor: the same with the hash "
        "and a decode at the smallest DCT scale (1/8) alone, what no pipeline gets above.",
        "",
        "| images | decoded at | hash | decode | preprocess | signature | model (1 thread) | bound "
        "| decode at 1/8 | floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {split['decoded_size']} | {split['hash_cpu_ms']:.2f} | {split['decode_cpu_ms']:.2f} | "
        f"{split['preprocess_cpu_ms']:.2f} | {split['signature_cpu_ms']:.2f} | "
        f"{model_cpu['one_thread']:.1f} | {split['bound']:.2f}x | {split['smallest_decode_cpu_ms']:.2f} | "
        f"{split['floor']:.2f}x |"
        for name, split in meta["cost_split"].items()
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
