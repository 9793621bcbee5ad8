"""The second attack on a real server (issue 24's "Done when"): new hostile files in every accepted format
and some refused ones, hostile labels and file names, sent to ``dmlsearch serve`` under an address-space cap.

    python bench/attack.py  # writes bench/results/attack_session13_run.json and .md

Makes a small gallery (lib.images.write_labelled_folder), a small seeded model (export_small_model, needs
torch) and an index with ``dmlsearch build-index``, then starts ``dmlsearch serve`` with its default limits
and writes enabled under ``--address-space`` (3 GB: ``prlimit --as=3000000000``). Each file of
lib.hostile_images.HOSTILE_SECOND (made on the spot) is sent to ``/v1/search``, then to ``/v1/items``
(with the key); an added item's thumbnail and original are fetched. For each: the answers, the seconds, the
server's peak RSS over its RSS before (``VmHWM`` after ``clear_refs``; decodes run in worker processes of
their own, with their own limits), and whether a normal search is still answered 200. Then ``build-index``
on a folder of all the files. Written to ``--out`` (JSON and a Markdown table beside it).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from lib.hostile_images import HOSTILE_SECOND
from lib.images import export_small_model, image_bytes, make_image, write_labelled_folder
from lib.options import bench_parser, out_option
from lib.servers import ServerProcess, serving

MB = 1024**2
API_KEY = "attack-key-0123456789"  # the key writes are enabled with, on the server this script starts
KEY = {"X-API-Key": API_KEY}
SUFFIXES = {"jpeg": ".jpg", "mpo": ".jpg", "png": ".png", "apng": ".png", "gif": ".gif", "tiff": ".tif"}
SUFFIXES |= {
    "bmp": ".bmp",
    "webp": ".webp",
    "heic": ".heic",
    "jpeg2000": ".jp2",
    "eps": ".eps",
    "cur": ".cur",
}
# Labels and file names an attacker would try on /v1/items (each with a valid image).
HOSTILE_LABELS = {
    "label-path-traversal": "../../outside",
    "label-10k-chars": "a" * 10_000,
    "label-nul": "cat\x00dog",
    "label-markdown-beacon": "![x](https://attacker.example/?beacon)",
    "label-rtl-override": "cat\u202egpj.exe",
}
HOSTILE_NAMES = {
    "filename-path-traversal": "../../../../tmp/evil.png",
    "filename-nul": "a\x00.png",
    "filename-png-named-jpg": "photo.jpg",  # a PNG: stored by its content as .png
}

# Query-string values on read endpoints (no key): each must get a 4xx or a 200, never a 5xx.
HOSTILE_QUERIES = {
    "item-id-2^64": "/v1/items/18446744073709551616",
    "thumbnail-size-nan": "/v1/items/1/thumbnail?size=NaN",
    "thumbnail-size-1e309": "/v1/items/1/thumbnail?size=1e309",
    "similar-k-huge": "/v1/items/1/similar?k=99999999999999999999",
    "items-offset-negative": "/v1/items?offset=-1",
    "items-limit-overflow": "/v1/items?limit=9223372036854775808",
    "similar-label-lone-surrogate": "/v1/items/1/similar?label=%ED%A0%80",
    "similar-path-prefix-nul": "/v1/items/1/similar?path_prefix=%00",
    "duplicates-threshold-inf": "/v1/duplicates?threshold=inf",
    "labels-repeated-10k-params": "/v1/labels?" + "&".join(["x=1"] * 10_000),
}


def timed(send) -> tuple[httpx.Response | str, float]:
    started = time.monotonic()
    try:
        answer: httpx.Response | str = send()
    except httpx.HTTPError as err:
        answer = f"{type(err).__name__}"
    return answer, time.monotonic() - started


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``: the decode forkserver and its workers."""
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            stack += children
    return found


def proc_status(pid: int, field: str) -> int:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:  # ended meanwhile
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith(f"{field}:")), 0)


class WorkerPeak:
    """The largest peak RSS (``VmHWM``, reset first) of any decode process during a block, sampled every
    20 ms (a worker retired before a sample is missed: the figure is a lower bound)."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.peak, self._stop = server, 0, threading.Event()

    def __enter__(self) -> WorkerPeak:
        for pid in descendants(self.server.process.pid):
            with contextlib.suppress(OSError):
                Path(f"/proc/{pid}/clear_refs").write_text("5")
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            peaks = [proc_status(pid, "VmHWM") for pid in descendants(self.server.process.pid)]
            self.peak = max([self.peak, *peaks])


def answer_of(response: httpx.Response | str) -> str:
    if isinstance(response, str):
        return response
    try:
        error = response.json().get("error")
    except ValueError:
        error = None
    return f"{response.status_code} {error['code']}" if error else str(response.status_code)


def normal_search(server: ServerProcess) -> int:
    files = {"image": ("q.png", image_bytes(make_image(3)))}
    return httpx.post(f"{server.url}/v1/search", files=files, timeout=120).status_code


def attack_file(server: ServerProcess, name: str, data: bytes, gallery: Path) -> dict:
    before = server.status("VmRSS")
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")
    with WorkerPeak(server) as workers:
        searched, search_s = timed(
            lambda: httpx.post(f"{server.url}/v1/search", files={"image": ("q", data)}, timeout=300)
        )
    suffix = SUFFIXES.get(name.split("-")[0], ".jpg")
    added, add_s = timed(
        lambda: httpx.post(
            f"{server.url}/v1/items",
            files={"images": (f"{name}{suffix}", data)},
            data={"label": "attack"},
            headers=KEY,
            timeout=300,
        )
    )
    peak = server.status("VmHWM") - before
    row = {
        "case": name,
        "bytes": len(data),
        "search": answer_of(searched),
        "search_s": round(search_s, 2),
        "add": answer_of(added),
        "add_s": round(add_s, 2),
        "peak_rss_mb": round(peak / MB, 1),
        "worker_peak_mb": round(workers.peak / MB, 1),
    }
    if isinstance(added, httpx.Response) and added.status_code == 201:
        item = added.json()["items"][0]
        thumbnail, row["thumbnail_s"] = timed(
            lambda: httpx.get(f"{server.url}/v1/items/{item['id']}/thumbnail?size=128", timeout=300)
        )
        original = httpx.get(f"{server.url}/v1/items/{item['id']}/image", timeout=60)
        row["thumbnail"] = answer_of(thumbnail)
        row["stored_as"] = item["path"]
        row["original"] = f"{original.status_code} {original.headers.get('content-type')}"
        row["nosniff"] = original.headers.get("x-content-type-options") == "nosniff"
        row["stored_bytes_equal"] = (gallery / item["path"]).read_bytes() == data
    row["alive_after"] = server.process.poll() is None and normal_search(server) == 200
    return row


def attack_upload_fields(server: ServerProcess, gallery: Path) -> list[dict]:
    rows = []
    requests = [(case, "ok.png", label) for case, label in HOSTILE_LABELS.items()]
    requests += [(case, filename, "fine") for case, filename in HOSTILE_NAMES.items()]
    for seed, (case, filename, label) in enumerate(requests, start=100):
        image = image_bytes(make_image(seed))  # a new image each: the same one twice is a 409 duplicate
        added, seconds = timed(
            lambda filename=filename, label=label, image=image: httpx.post(
                f"{server.url}/v1/items",
                files={"images": (filename, image)},
                data={"label": label},
                headers=KEY,
                timeout=60,
            )
        )
        row = {"case": case, "add": answer_of(added), "add_s": round(seconds, 2)}
        if isinstance(added, httpx.Response) and added.status_code == 201:
            path = (gallery / added.json()["items"][0]["path"]).resolve()
            row["stored_as"] = added.json()["items"][0]["path"]
            row["inside_gallery"] = path.is_relative_to(gallery.resolve()) and path.is_file()
        row["alive_after"] = server.process.poll() is None and normal_search(server) == 200
        rows.append(row)
    return rows


def attack_queries(server: ServerProcess) -> list[dict]:
    rows = []
    for case, path in HOSTILE_QUERIES.items():
        answer, seconds = timed(lambda path=path: httpx.get(f"{server.url}{path}", timeout=60))
        rows.append({"case": case, "answer": answer_of(answer), "seconds": round(seconds, 2)})
    return rows


def build_index(files: dict[str, bytes], model: Path, work: Path) -> dict:
    folder = work / "hostile_gallery"
    for name, data in files.items():
        (folder / "attack").mkdir(parents=True, exist_ok=True)
        (folder / "attack" / f"{name}{SUFFIXES.get(name.split('-')[0], '.jpg')}").write_bytes(data)
    (folder / "fine").mkdir()
    for seed in range(3):
        (folder / "fine" / f"{seed}.png").write_bytes(image_bytes(make_image(seed)))
    command = [sys.executable, "-m", "cli.main", "build-index", str(folder), "--model", str(model)]
    started = time.monotonic()
    result = subprocess.run([*command, "--out", str(work / "hostile_index")], capture_output=True, text=True)
    output = (result.stdout + result.stderr).replace(str(folder) + "/", "")
    skipped = [line.strip() for line in output.splitlines() if line.strip().startswith("attack/")]
    return {
        "returncode": result.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "files": len(files) + 3,
        "skipped": skipped,
        "tail": output.strip().splitlines()[-3:],
    }


def markdown(result: dict) -> str:
    lines = [
        "| case | bytes | /v1/search | s | /v1/items | s | thumbnail | stored as "
        "| server +MB | worker MB | ok after |",
        "|---|---:|---|---:|---|---:|---|---|---:|---:|---|",
    ]
    for row in result["files"]:
        lines.append(
            f"| {row['case']} | {row['bytes']} | {row['search']} | {row['search_s']} | {row['add']} | "
            f"{row['add_s']} | {row.get('thumbnail', '-')} | {row.get('stored_as', '-')} | "
            f"{row['peak_rss_mb']} | {row['worker_peak_mb']} | {row['alive_after']} |"
        )
    lines += [
        "",
        "| case | /v1/items | s | stored as | inside gallery | fine after |",
        "|---|---|---:|---|---|---|",
    ]
    for row in result["fields"]:
        lines.append(
            f"| {row['case']} | {row['add']} | {row['add_s']} | {row.get('stored_as', '-')} | "
            f"{row.get('inside_gallery', '-')} | {row['alive_after']} |"
        )
    lines += ["", "| query | answer | s |", "|---|---|---:|"]
    lines += [f"| {row['case']} | {row['answer']} | {row['seconds']} |" for row in result["queries"]]
    build = result["build_index"]
    lines += [
        "",
        f"build-index on all {build['files']} files: exit {build['returncode']} in {build['seconds']} s;",
    ]
    lines += [f"- {line}" for line in build["skipped"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, out_option(Path("bench/results/attack_session13_run.json")))
    parser.add_argument("--address-space", type=int, default=3_000_000_000)
    parser.add_argument("--cases", nargs="*", default=sorted(HOSTILE_SECOND), help="names in HOSTILE_SECOND")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        gallery = write_labelled_folder(work / "gallery", classes=3, per_class=3)
        model = export_small_model(work / "model" / "model.onnx", seed=7)
        build = [sys.executable, "-m", "cli.main", "build-index", str(gallery), "--model", str(model)]
        subprocess.run([*build, "--out", str(work / "index")], check=True, capture_output=True)
        serve = ["--index", str(work / "index"), "--model", str(model), "--rate-limit", "0"]
        files = {name: HOSTILE_SECOND[name]() for name in args.cases}
        result: dict = {"address_space": args.address_space, "files": []}
        env = {"DMLSEARCH_API_KEY": API_KEY}
        with serving(serve, env, address_space=args.address_space, log=work / "server.log") as server:
            result["idle_rss_mb"] = round(server.status("VmRSS") / MB, 1)
            for name, data in files.items():
                result["files"].append(attack_file(server, name, data, gallery))
                print(json.dumps(result["files"][-1]), flush=True)
            result["fields"] = attack_upload_fields(server, gallery)
            result["queries"] = attack_queries(server)
            result["alive_at_end"] = server.process.poll() is None and normal_search(server) == 200
        result["server_log_errors"] = [
            line
            for line in (work / "server.log").read_text().splitlines()
            if "Traceback" in line or " 500 " in line
        ]
        result["build_index"] = build_index(files, model, work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
