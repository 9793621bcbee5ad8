"""Issue 42 tried as an operator would, in one rerunnable script:

    PYTHONPATH=. python bench/operator_walkthrough.py [--keep]

A real ``milvus-server`` (Milvus 2.3.5) with logins required, its ``root`` password changed to a random one
given to dmlsearch in a file (``DMLSEARCH_MILVUS_PASSWORD_FILE``); one shared photo folder; ``build-index``
into one collection; two replicas (``dmlsearch serve`` processes) each in its own working folder with its
own copy of the index directory. Through both: adds, deletes and judgments (``POST /v1/feedback``); one
``train --feedback`` run that must see every judgment; a rebuild through each working folder while both
serve; a restart of Milvus under them (SIGTERM to its process group, SIGKILL after 10 s: it ignores SIGTERM,
docs/milvus.md), then: nothing deleted came back, nothing was lost, and neither secret (the Milvus password,
the API key) appears in any log, manifest, process command line, answer, error or file under the working
folders. Writes ``bench/results/operator_walkthrough.md``; exits 1 if any check failed. About 15-20 minutes,
most of it the ``train --feedback`` run, which fine-tunes (issue 40: 819 s of a 1032 s run at load 10-13).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from lib.images import image_bytes, make_image
from lib.servers import ServerProcess, free_port, serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' start and stop of the real server
from foundation import defaults
from tests.support.milvus_server import MilvusServerProcess

OUT = Path(__file__).parent / "results" / "operator_walkthrough.md"
LABELS, PER_LABEL = 4, 8  # the shared folder's photos: label0..label3, 8 each
UPLOADS = 3  # per replica
QUERIES, TOP = 16, 5  # judged: each query item's top 5, half of the queries through each replica
COLLECTION = "operator_photos"
WAIT_S = 120  # the most a replica may take to see the other's write, or to answer again after the restart


class Walkthrough:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.rows: list[tuple[str, str, str]] = []
        self.failed: list[str] = []
        self.texts: dict[str, str] = {}  # every output and answer, searched for the secrets at the end
        self.password = f"Pw-{secrets.token_hex(8)}"
        self.api_key = f"key-{secrets.token_hex(8)}"
        self.started = time.monotonic()

    def step(self, what: str, result: str) -> None:
        elapsed = f"{time.monotonic() - self.started:.0f}"
        print(f"[{elapsed:>4} s] {what}: {result}", flush=True)
        self.rows.append((elapsed, what, result))

    def check(self, what: str, ok: bool, detail: str) -> bool:
        self.step(what, ("ok: " if ok else "FAILED: ") + detail)
        if not ok:
            self.failed.append(what)
        return ok


def _clean_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("DMLSEARCH_")}


def cli(walk: Walkthrough, where: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``dmlsearch ARGS`` run in the working folder ``where``; its output is appended to ``where/cli.log``."""
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=where,
        env={**_clean_environment(), **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = done.stdout + done.stderr
    with (where / "cli.log").open("a") as log:
        log.write(f"$ dmlsearch {' '.join(args)}\n{output}\n")
    walk.texts[f"{where.name}: dmlsearch {args[0]} #{len(walk.texts)}"] = output
    return done


def wait_for(condition: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``condition`` held, or None if it never did within ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        with contextlib.suppress(httpx.HTTPError):
            if condition():
                return time.monotonic() - started
        time.sleep(0.1)
    return None


def all_items(base: str) -> dict[int, dict]:
    page = httpx.get(f"{base}/v1/items", params={"limit": 1000}, timeout=60)
    page.raise_for_status()
    return {item["id"]: item for item in page.json()["items"]}


def search_paths(base: str, image: bytes) -> list[str]:
    found = httpx.post(f"{base}/v1/search", params={"k": 3}, files={"image": ("q.png", image)}, timeout=60)
    found.raise_for_status()
    return [result["path"] for result in found.json()["results"]]


def status(response: httpx.Response) -> str:
    """The status, and the body of an error (what went wrong, in the report)."""
    return f"{response.status_code}" + (f" {response.text[:300]}" if response.status_code >= 400 else "")


def judgment_total(base: str) -> int:
    return int(httpx.get(f"{base}/v1/feedback", params={"limit": 1}, timeout=60).json()["total"])


def secret_hits(text: str, walk: Walkthrough) -> list[str]:
    return [
        name for name, secret in (("password", walk.password), ("API key", walk.api_key)) if secret in text
    ]


def run(walk: Walkthrough) -> None:
    work = walk.work
    photos, secret_dir = work / "shared-photos", work / "secrets"
    builder, trainer = work / "builder", work / "trainer"
    replicas = {"A": work / "replica-a", "B": work / "replica-b"}
    for folder in (photos, secret_dir, builder, trainer, *replicas.values()):
        folder.mkdir(parents=True)

    # The model: the pretrained backbone exported, as `dmlsearch export` does without a run.
    model = builder / "model" / "model.onnx"
    done = cli(walk, builder, {}, "export", "--out", str(model))
    walk.check("export the pretrained model", done.returncode == 0, done.stdout.strip()[-200:])

    # Milvus with logins on; root's password changed from Milvus's first one to a random one.
    server = MilvusServerProcess(work / "milvus-data", free_port(), auth=True)
    server.start()
    server.client().update_password("root", "Milvus", walk.password)
    server.token = f"root:{walk.password}"
    password_file = secret_dir / "milvus-password"
    password_file.write_text(walk.password + "\n")
    password_file.chmod(0o600)
    milvus_env = {"DMLSEARCH_MILVUS_USER": "root", "DMLSEARCH_MILVUS_PASSWORD_FILE": str(password_file)}
    walk.step("milvus-server with logins on", f"{server.uri}, root's password changed, given in a file")
    try:
        _serve_and_operate(walk, server, model, photos, builder, trainer, replicas, milvus_env)
    finally:
        server.stop()
    for name, folder in (("Milvus's own data folder", server.data),):
        leaked = [
            str(path.relative_to(work))
            for path in folder.rglob("*")
            if path.is_file() and secret_hits(path.read_bytes().decode(errors="replace"), walk)
        ]
        walk.step(f"(for information) {name} holds the password in", ", ".join(leaked) or "no file")


def _serve_and_operate(
    walk: Walkthrough,
    server: MilvusServerProcess,
    model: Path,
    photos: Path,
    builder: Path,
    trainer: Path,
    replicas: dict[str, Path],
    milvus_env: dict[str, str],
) -> None:
    originals = []
    for label in range(LABELS):
        (photos / f"label{label}").mkdir()
        for n in range(PER_LABEL):
            make_image(1000 * label + n).save(photos / f"label{label}" / f"{n}.png")
            originals.append(f"label{label}/{n}.png")
    where = ["--backend", "milvus", "--milvus-uri", server.uri, "--milvus-collection", COLLECTION]
    build = ["build-index", str(photos), "--model", str(model), "--no-progress"]
    done = cli(walk, builder, milvus_env, *build, "--out", str(builder / "index"), *where)
    walk.check(
        "build-index into the collection",
        done.returncode == 0 and f"indexed {len(originals)} images" in done.stdout,
        done.stdout.strip().splitlines()[0] if done.stdout.strip() else done.stderr[-300:],
    )
    for folder in replicas.values():  # each machine's own copy of the index directory and the model
        shutil.copytree(builder / "index", folder / "index")
        shutil.copytree(model.parent, folder / "model")

    serve_env = {**milvus_env, "DMLSEARCH_API_KEY": walk.api_key}
    key = {"X-API-Key": walk.api_key}
    with contextlib.ExitStack() as stack:
        api: dict[str, ServerProcess] = {}
        for name, folder in replicas.items():
            args = ["--index", "index", "--model", "model/model.onnx", "--rate-limit", "0"]
            with contextlib.chdir(folder):  # each replica runs in its own working folder
                api[name] = stack.enter_context(
                    serving(
                        args, {**_clean_environment(), **serve_env}, log=folder / "serve.log", timeout=300
                    )
                )
        a, b = api["A"].url, api["B"].url
        walk.step("two replicas serving", f"A {a} in {replicas['A'].name}/, B {b} in {replicas['B'].name}/")

        # Process listing while everything runs: command lines, and the replicas' environments.
        listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        walk.texts["ps -eo pid,args"] = listing
        cmdlines = {
            path.parent.name: path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            for path in Path("/proc").glob("[0-9]*/cmdline")
            if path.exists() and os.access(path, os.R_OK)
        }
        walk.texts["/proc/*/cmdline"] = "\n".join(cmdlines.values())
        environs = {
            name: Path(f"/proc/{process.process.pid}/environ").read_bytes().decode(errors="replace")
            for name, process in api.items()
        }
        walk.check(
            "the Milvus password in no replica's environment (it is given as a file)",
            not any(walk.password in text for text in environs.values()),
            "DMLSEARCH_MILVUS_PASSWORD_FILE names the file; the API key is DMLSEARCH_API_KEY in each "
            "replica's environment (readable by its user only, as a process's environment is)",
        )

        # Adds through both; each replica sees the other's.
        uploads: dict[str, dict] = {}
        for name in ("A", "B"):
            for n in range(UPLOADS):
                seed = 50_000 + 100 * ord(name) + n
                added = httpx.post(
                    f"{api[name].url}/v1/items",
                    files={"images": (f"upload-{name}{n}.png", image_bytes(make_image(seed), "PNG"))},
                    data={"label": f"label{n % LABELS}"},
                    headers=key,
                    timeout=120,
                )
                if walk.check(f"add through {name}", added.status_code == 201, status(added)):
                    item = added.json()["items"][0]
                    uploads[item["path"]] = {**item, "seed": seed, "through": name}
        for name, other in (("A", b), ("B", a)):
            ids = [item["id"] for item in uploads.values() if item["through"] == name]
            seen = wait_for(
                lambda ids=ids, other=other: all(
                    httpx.get(f"{other}/v1/items/{i}", timeout=10).status_code == 200 for i in ids
                ),
                WAIT_S,
            )
            walk.check(
                f"the other replica sees the adds through {name}",
                seen is not None,
                f"after {seen:.2f} s" if seen is not None else "never",
            )
        walk.check(
            "uploads are in the shared folder",
            all((photos / path).is_file() for path in uploads),
            ", ".join(sorted(uploads)),
        )

        # Deletes through both: each deletes one of the other's uploads and one original photo.
        items = all_items(a)
        by_path = {item["path"]: item for item in items.values()}
        doomed = {
            "A": [next(p for p, u in uploads.items() if u["through"] == "B"), originals[1]],
            "B": [next(p for p, u in uploads.items() if u["through"] == "A"), originals[PER_LABEL + 1]],
        }
        deleted: dict[str, bytes] = {}  # path -> its bytes, to search for it later
        for name, paths in doomed.items():
            for path in paths:
                content = (photos / path).read_bytes()
                removed = httpx.delete(
                    f"{api[name].url}/v1/items/{by_path[path]['id']}", headers=key, timeout=120
                )
                ok = removed.status_code == 200
                if walk.check(f"delete {path} through {name}", ok, status(removed)):
                    deleted[path] = content
        gone = wait_for(
            lambda: all(
                httpx.get(f"{base}/v1/items/{by_path[p]['id']}", timeout=10).status_code == 404
                for base in (a, b)
                for p in deleted
            ),
            WAIT_S,
        )
        walk.check(
            "both replicas lose the deleted items",
            gone is not None,
            f"after {gone:.2f} s" if gone is not None else "never",
        )
        expected = sorted((set(originals) | set(uploads)) - set(deleted))

        # Judgments through both: a query item's top results by class (👍 its label, 👎 another).
        items = all_items(a)
        rng = random.Random(0)
        queries = rng.sample(sorted(items), QUERIES)
        made = {"A": 0, "B": 0}
        for n, query in enumerate(queries):
            name = "A" if n % 2 == 0 else "B"
            base = api[name].url
            similar = httpx.get(f"{base}/v1/items/{query}/similar", params={"k": TOP}, timeout=60)
            similar.raise_for_status()
            for result in similar.json()["results"]:
                sign = 1 if result["label"] == items[query]["label"] else -1
                body = {"query_item": query, "result": result["id"], "sign": sign}
                judged = httpx.post(f"{base}/v1/feedback", json=body, headers=key, timeout=60)
                if judged.status_code != 201:
                    walk.check(f"judge through {name}", False, f"{judged.status_code} {judged.text[:200]}")
                    break
                made[name] += 1
        total = made["A"] + made["B"]
        walk.step(
            "judgments made", f"{made['A']} through A, {made['B']} through B ({QUERIES} queries' top {TOP})"
        )
        for name in ("A", "B"):
            # The last ones were made through B: A lists them once Milvus has applied them.
            seen = wait_for(lambda name=name: judgment_total(api[name].url) == total, WAIT_S)
            walk.check(
                f"replica {name} lists every judgment",
                seen is not None,
                f"{total} after {seen:.2f} s" if seen is not None else f"not within {WAIT_S} s",
            )

        # One training run on the judgments, through replica B's working folder's index directory.
        run_dir = trainer / "run"
        done = cli(
            walk,
            trainer,
            milvus_env,
            "train",
            "--loss",
            "triplet",
            "--feedback",
            str(replicas["B"] / "index"),
            "--out",
            str(run_dir),
            "--cache-dir",
            str(trainer / "cache"),
            *("-p", "max_steps=20", "-p", "eval_every=10", "-p", "embedding_dim=16", "-p", "head_hidden=32"),
        )
        gate = {}
        if done.returncode == 0:
            gate = json.loads((run_dir / "summary.json").read_text()).get("feedback") or {}
        used = sum(gate.get(f"judgments_{part}", 0) for part in ("trained", "validation", "held_out"))
        walk.check(
            "train --feedback finds the judgments made through both replicas",
            done.returncode == 0 and used == total,
            f"{used} of {total} (trained {gate.get('judgments_trained')}, validation "
            f"{gate.get('judgments_validation')}, held out {gate.get('judgments_held_out')})"
            if done.returncode == 0
            else done.stderr[-400:],
        )

        # A rebuild through each working folder while both serve: nothing new, nothing removed.
        for folder in replicas.values():
            done = cli(walk, folder, milvus_env, *build, "--out", "index")
            walk.check(
                f"rebuild through {folder.name}/",
                done.returncode == 0 and "indexed 0 images" in done.stdout and "0 removed" in done.stdout,
                done.stdout.strip().splitlines()[0] if done.stdout.strip() else done.stderr[-300:],
            )

        # Milvus restarted under the serving replicas.
        query = (photos / originals[0]).read_bytes()
        stopped = time.monotonic()
        server.stop()
        walk.step(
            "Milvus stopped", f"SIGTERM to its group, SIGKILL after 10 s: {time.monotonic() - stopped:.1f} s"
        )
        for name in ("A", "B"):
            asked = time.monotonic()
            ready = httpx.get(f"{api[name].url}/readyz", timeout=60)
            searched = httpx.post(
                f"{api[name].url}/v1/search", params={"k": 1}, files={"image": ("q.png", query)}, timeout=60
            )
            took = time.monotonic() - asked
            walk.texts[f"{name} /readyz while down"] = ready.text
            walk.texts[f"{name} search while down"] = searched.text
            walk.check(
                f"replica {name} while Milvus is down",
                ready.status_code == 503 and searched.status_code == 503,
                f"/readyz {ready.status_code}, search {searched.status_code} "
                f"({searched.json().get('error', {}).get('code')}), both in {took:.1f} s",
            )
        restarted = time.monotonic()
        server.start()
        walk.step(
            "Milvus started again on its folder", f"answering after {time.monotonic() - restarted:.1f} s"
        )
        for name in ("A", "B"):
            back = wait_for(
                lambda name=name: (
                    httpx.get(f"{api[name].url}/readyz", timeout=30).status_code == 200
                    and bool(search_paths(api[name].url, query))
                    and httpx.get(f"{api[name].url}/v1/feedback", timeout=30).status_code == 200
                ),
                WAIT_S,
            )
            walk.check(
                f"replica {name} answers again by itself (/readyz, a search, /v1/feedback) within the "
                f"{defaults.INDEX_DEADLINE_SECONDS:g} s deadline",
                back is not None and back < defaults.INDEX_DEADLINE_SECONDS,
                f"200 {back:.1f} s after Milvus answered" if back is not None else f"not within {WAIT_S} s",
            )

        # Nothing came back, nothing was lost.
        for name in ("A", "B"):
            paths = sorted(item["path"] for item in all_items(api[name].url).values())
            walk.check(
                f"replica {name} holds exactly the photos kept",
                paths == expected,
                f"{len(paths)} items, {len(expected)} expected; "
                f"missing {sorted(set(expected) - set(paths))}, back {sorted(set(paths) & set(deleted))}",
            )
            back = {path for path, content in deleted.items() if path in search_paths(api[name].url, content)}
            walk.check(
                f"searching replica {name} with each deleted photo finds none of them",
                not back,
                f"found {sorted(back)}" if back else f"{len(deleted)} searched",
            )
            listed = judgment_total(api[name].url)
            walk.check(f"replica {name} still lists every judgment", listed == total, f"{listed} of {total}")
        trash = photos / ".dmlsearch-trash"
        kept_aside = sorted(p.name for p in trash.rglob("*.png")) if trash.is_dir() else []
        walk.check(
            "the deleted photos are set aside in the shared folder's trash",
            len(kept_aside) == len(deleted),
            ", ".join(kept_aside),
        )
        walk.texts |= {
            f"{name} {path}": httpx.get(f"{api[name].url}{path}", timeout=60).text
            for name in ("A", "B")
            for path in (
                "/readyz",
                "/metrics",
                "/v1/stats",
                "/v1/model",
                "/v1/items?limit=1000",
                "/v1/feedback",
            )
        }

    done = cli(walk, replicas["A"], milvus_env, *build, "--out", "index")
    walk.check(
        "a build-index after the restart indexes nothing again",
        done.returncode == 0 and "indexed 0 images" in done.stdout and "0 removed" in done.stdout,
        done.stdout.strip().splitlines()[0] if done.stdout.strip() else done.stderr[-300:],
    )

    # The secrets: in no output or answer collected above, and no file under the working folders.
    leaked = {where: hits for where, text in walk.texts.items() if (hits := secret_hits(text, walk))}
    walk.check(
        f"neither secret in any of {len(walk.texts)} outputs, answers, errors and process listings",
        not leaked,
        json.dumps(leaked) if leaked else "none found",
    )
    searched = [
        path for folder in (photos, builder, trainer, *replicas.values()) for path in folder.rglob("*")
    ]
    files = [path for path in searched if path.is_file()]
    leaked_files = [
        str(path.relative_to(walk.work))
        for path in files
        if secret_hits(path.read_bytes().decode(errors="replace"), walk)
    ]
    logs = sorted(str(p.relative_to(walk.work)) for p in files if p.suffix in (".log", ".json"))
    walk.check(
        f"neither secret in any of {len(files)} files under the working folders",
        not leaked_files,
        f"found in {leaked_files}" if leaked_files else f"none (among them {', '.join(logs[:12])}, ...)",
    )


def write_report(walk: Walkthrough, loads: tuple[str, str], seconds: float) -> None:
    lines = [
        "# Issue 42 tried as an operator would",
        "",
        "`PYTHONPATH=. python bench/operator_walkthrough.py` (this file is its output; rerun it to check).",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {seconds:.0f} s, one shared 2-core "
        f"machine (load average at the start {loads[0]}, at the end {loads[1]}).",
        "",
        "Set-up: a real `milvus-server` (Milvus 2.3.5) with logins on and root's password changed to a",
        "random one, given to every dmlsearch process as `DMLSEARCH_MILVUS_USER` and",
        f"`DMLSEARCH_MILVUS_PASSWORD_FILE`; a shared folder of {LABELS * PER_LABEL} photos; `build-index`",
        f"into the collection `{COLLECTION}`; two replicas (`dmlsearch serve`), each in its own working",
        "folder with its own copy of the index directory and the model. Judgments are kept in the Milvus",
        f"collection `{COLLECTION}_judgments` beside the vectors, so every replica, and `train --feedback`",
        "given any copy of the index directory, reads the same ones.",
        "",
        "| s | Step | Result |",
        "|---|---|---|",
        *(f"| {elapsed} | {what} | {result.replace('|', '/')} |" for elapsed, what, result in walk.rows),
        "",
        f"**{len(walk.failed)} check(s) failed**" + (f": {', '.join(walk.failed)}" if walk.failed else "."),
        "",
    ]
    OUT.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", action="store_true", help="keep the working folders (printed) afterwards")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dmlsearch-operator-"))
    walk = Walkthrough(work)
    start_load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        run(walk)
    except Exception as err:  # a step that could not go on: reported, not hidden
        walk.check("the walkthrough ran to its end", False, f"{type(err).__name__}: {err}"[:500])
        raise
    finally:
        end_load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        write_report(walk, (start_load, end_load), time.monotonic() - walk.started)
        if options.keep:
            print(f"working folders kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(walk.failed)} check(s) failed; report in {OUT}")
    return 1 if walk.failed else 0


if __name__ == "__main__":
    sys.exit(main())
