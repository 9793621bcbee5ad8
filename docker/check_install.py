"""Build the images with podman and run them for real: the API image, the UI and compose.

    python docker/check_install.py                   # base, serving image, API, UI, compose's api and ui
    python docker/check_install.py --compose full    # + the train image and compose's setup (8 GB more)
    python docker/check_install.py --compose none    # base, serving image, API, UI

1. A base image without a registry: `debootstrap` a Debian bookworm root with python3 and its venv module,
   then `podman import` it (kept as BASE_TAG and reused by later runs).
2. `podman build` of docker/Dockerfile with its FROM pointed at that base (the BASE_IMAGE build argument).
   The host's pip configuration, CA bundle and local wheel folders are mounted read-only into the build, so
   it installs from the same places as the host (and they stay out of the image).
3. The API image serves a demo index (made on the host with `dmlsearch demo --no-serve`): /readyz answers
   200, a search answers 200 with results, SIGTERM ends the container with exit code 0.
4. The same image as the UI (`dmlsearch ui`): its health answers 200, SIGTERM gives exit code 0.
5. compose (podman-compose): `api` answers a search and `ui` its health, both from the serving image;
   SIGTERM stops each with exit code 0. By default they serve the host's demo (mounted by an override file
   at its host path, so the index's paths hold); with `--compose full`, `setup` first builds the train
   image's demo into compose's volume and must exit 0 (the train image is 7 GB and takes 15 minutes).

Every container runs with runc and raised-but-fixed ulimits (a containers.conf written for the run): crun
refuses this machine's cgroup layout, and root may not raise its own limits here. Prints the measured
figures (build seconds, image sizes, seconds to first search, exit codes). Exit 0: every check passed;
exit 3: this machine cannot run the check (the reason is printed); anything else: a check failed.
"""

from __future__ import annotations

import argparse
import configparser
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# The CLI installed beside this interpreter: `make test` runs pytest from .venv/bin without it on PATH.
HOST_CLI = Path(sys.executable).with_name("dmlsearch")
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = REPO / "docker" / "compose.yaml"
BASE_TAG = "localhost/dmlsearch-base:bookworm"
SERVE_TAG = "localhost/dmlsearch:cpu"
TRAIN_TAG = "localhost/dmlsearch:train"
BASE_PACKAGES = "python3,python3-venv,libgomp1,curl,ca-certificates"
DEBIAN_MIRROR = os.environ.get("DMLSEARCH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# crun refuses this cgroup layout; root may not raise its own limits, so the containers get fixed ones.
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
"""
# pip settings whose values name files or folders on the host, which the build must see too.
PATH_SETTINGS = (
    "cert",
    "client-cert",
    "constraint",
    "requirement",
    "find-links",
    "index-url",
    "extra-index-url",
)
READY_SECONDS = 180
# Disk the check needs: base, serving image and pip's build caches; the train image adds about 8 GB.
SERVING_GIGABYTES = 6
FULL_GIGABYTES = 20
STOP_SECONDS = 30


class CannotRun(Exception):
    """This machine cannot run the check (no podman, no root for debootstrap...): a reason, not a failure."""


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def podman_output(*args: str) -> str:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_tools(compose: bool, free_gigabytes: float) -> None:
    needed = ["podman"] + (["podman-compose"] if compose else [])
    missing = [tool for tool in needed if shutil.which(tool) is None]
    if missing:
        raise CannotRun(f"{', '.join(missing)} not installed (Debian: apt-get install podman podman-compose)")
    storage = Path(podman_output("info", "--format", "{{.Store.GraphRoot}}"))
    storage.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(storage).free / 1e9
    if free < free_gigabytes:
        raise CannotRun(f"{free:.1f} GB free under {storage}; the images need {free_gigabytes:.0f} GB")


def require_containers() -> None:
    """A container of the base starts: where the runtime cannot start one at all, nothing here can run."""
    probe = subprocess.run(["podman", "run", "--rm", BASE_TAG, "true"], capture_output=True, text=True)
    if probe.returncode:
        raise CannotRun(f"podman cannot start a container here: {probe.stderr.strip()[-300:]}")


def host_pip_config() -> tuple[str, list[Path]]:
    """The host's effective pip configuration (files and PIP_* variables) as one pip.conf, and the host
    paths its values name (CA bundle, constraints, wheel folders, file:// indexes)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True
    ).stdout
    sections: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        name, _, quoted = line.partition("=")
        section, _, key = name.rpartition(".")
        sections.setdefault(section, {})[key] = quoted.strip().strip("'\"")
    # PIP_* variables (section ":env:") take precedence over the files' [global], as in pip itself.
    sections["global"] = {**sections.get("global", {}), **sections.pop(":env:", {})}
    settings = sections["global"]
    paths: set[Path] = set()
    for key in PATH_SETTINGS:
        for word in settings.get(key, "").split():
            path = Path(word.removeprefix("file://"))
            if not word.startswith(("/", "file://")) or not path.exists():
                continue
            # A file:// index lists its packages under simple/ and keeps the files beside it.
            paths.add(path.parent if path.name == "simple" else path)
    conf = configparser.ConfigParser()
    conf.read_dict(sections)
    with tempfile.TemporaryFile("w+") as text:
        conf.write(text)
        text.seek(0)
        return text.read(), sorted(paths)


def ensure_base(rebuild: bool) -> str:
    """The local base image: reused when present, else debootstrapped and imported."""
    exists = subprocess.run(["podman", "image", "exists", BASE_TAG]).returncode == 0
    if exists and not rebuild:
        return "reused"
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise CannotRun("the base image needs debootstrap, run as root (apt-get install debootstrap)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dmlsearch-base-", dir="/var/tmp") as folder:
        root = Path(folder) / "root"
        try:
            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={BASE_PACKAGES}",
                    "bookworm",
                    str(root),
                    DEBIAN_MIRROR,
                ]
            )
        except subprocess.CalledProcessError as err:  # e.g. the mirror out of reach: nothing to build on
            reason = f"debootstrap of the base failed (exit {err.returncode}; {DEBIAN_MIRROR})"
            raise CannotRun(reason) from err
        # Package downloads and lists serve no purpose in an image.
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        run(["podman", "import", "--change", 'CMD ["/bin/bash"]', "-", BASE_TAG], stdin=tar.stdout)
        if tar.wait():
            raise RuntimeError("tar of the debootstrapped root failed")
    return f"built in {time.monotonic() - started:.0f} s"


def build(target: str, tag: str, workdir: Path) -> float:
    """`podman build` of one Dockerfile stage on the local base; the seconds it took."""
    pip_conf, host_paths = host_pip_config()
    conf_file = workdir / "pip.conf"
    conf_file.write_text(pip_conf)
    mounts = ["--volume", f"{conf_file}:/etc/pip.conf:ro"]
    for path in host_paths:
        mounts += ["--volume", f"{path}:{path}:ro"]
    started = time.monotonic()
    run(
        [
            "podman", "build", "--file", str(DOCKERFILE), "--target", target, "--tag", tag,
            "--build-arg", f"BASE_IMAGE={BASE_TAG}",
            # PyPI stands in for PyTorch's CPU index, which cannot be reached from every machine.
            "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple",
            *mounts, str(REPO),
        ]
    )  # fmt: skip
    return time.monotonic() - started


def image_megabytes(tag: str) -> float:
    return int(podman_output("image", "inspect", "--format", "{{.Size}}", tag)) / 1e6


def wait_until(url: str, started: float, request=httpx.get, **kwargs) -> float:
    """Seconds from ``started`` until ``url`` answers 200 with a non-empty answer."""
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        try:
            answer = request(url, timeout=10, **kwargs)
            if answer.status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {READY_SECONDS} s")


def search(api: str, query: Path) -> int:
    """One search with a gallery photo; the number of results (a working index finds the photo itself)."""
    with query.open("rb") as image:
        answer = httpx.post(f"{api}/v1/search", files={"image": (query.name, image)}, timeout=60)
    if answer.status_code != 200:
        raise RuntimeError(f"the search answered {answer.status_code}: {answer.text}")
    results = answer.json()["results"]
    if not results:
        raise RuntimeError("the search answered no results")
    return len(results)


def stop_with_sigterm(container: str) -> int:
    """`podman stop`, as `docker stop` and Kubernetes do: SIGTERM, then SIGKILL after STOP_SECONDS (exit
    code 137). The container's exit code."""
    run(["podman", "stop", "--time", str(STOP_SECONDS), container])
    return int(podman_output("inspect", "--format", "{{.State.ExitCode}}", container))


@contextmanager
def container(name: str, *args: str) -> Iterator[str]:
    run(["podman", "run", "--detach", "--name", name, *args])
    try:
        yield name
    finally:
        logs = subprocess.run(["podman", "logs", "--tail", "20", name], capture_output=True, text=True)
        print(f"--- last log lines of {name}:\n{logs.stdout}{logs.stderr}", flush=True)
        # --volumes: the image's VOLUME /data gets an anonymous volume per container.
        subprocess.run(["podman", "rm", "--force", "--volumes", "--time", "5", name], capture_output=True)


def demo_data(workdir: Path) -> tuple[Path, Path]:
    """A demo model, gallery and index on the host (export needs torch, which the serving image has not);
    the folder is mounted at the same path in the containers, so the index's paths hold there."""
    data = workdir / "data"
    run([str(HOST_CLI), "demo", "--no-serve", "--workdir", str(data)])
    data.chmod(0o777)
    for path in data.rglob("*"):
        path.chmod(0o777 if path.is_dir() else 0o666)  # the image's user (uid 10001) writes its locks there
    query = next(path for path in sorted((data / "gallery").rglob("*")) if path.suffix in {".jpg", ".png"})
    return data, query


def check_api_and_ui(data: Path, query: Path, figures: dict[str, str]) -> None:
    api_port, ui_port = free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}"
    mount = ["--volume", f"{data}:{data}", "--env", f"DMLSEARCH_INDEX_PATH={data}/index"]
    started = time.monotonic()
    with container(
        "dmlsearch-check-api", *mount, "--publish", f"127.0.0.1:{api_port}:8000", SERVE_TAG
    ) as name:
        figures["API /readyz after start (s)"] = f"{wait_until(f'{api}/readyz', started):.1f}"
        figures["API search results"] = str(search(api, query))
        figures["API first search after start (s)"] = f"{time.monotonic() - started:.1f}"
        # The UI container reaches the API through the host's published port (host network for the UI).
        ui_command = ["dmlsearch", "ui", "--api-url", api, "--host", "127.0.0.1", "--port", str(ui_port)]
        ui_started = time.monotonic()
        with container("dmlsearch-check-ui", "--network", "host", SERVE_TAG, *ui_command) as ui:
            health = f"http://127.0.0.1:{ui_port}/_stcore/health"
            figures["UI health after start (s)"] = f"{wait_until(health, ui_started):.1f}"
            figures["UI exit code after SIGTERM"] = str(stop_with_sigterm(ui))
        figures["API exit code after SIGTERM"] = str(stop_with_sigterm(name))


def check_compose(workdir: Path, figures: dict[str, str], host_demo: Path | None) -> None:
    """compose's api and ui; ``host_demo`` (the host's demo folder) stands in for the `setup` step when
    given: an override file mounts it at its own path in `api` and points the served index there."""
    api_port, ui_port = free_port(), free_port()
    project = "dmlsearch-check"
    env = {
        **os.environ,
        "DMLSEARCH_API_PORT": str(api_port),
        "DMLSEARCH_UI_PORT": str(ui_port),
        "DMLSEARCH_BASE_IMAGE": BASE_TAG,
    }
    compose = ["podman-compose", "--project-name", project, "--file", str(COMPOSE)]
    if host_demo is not None:
        override = workdir / "compose.host-demo.yaml"
        override.write_text(f"services:\n  api:\n    volumes:\n      - {host_demo}:{host_demo}\n")
        compose += ["--file", str(override)]
        env["DMLSEARCH_INDEX"] = str(host_demo / "index")
    started = time.monotonic()
    try:
        if host_demo is None:
            # podman-compose 1.0 (Debian 12) starts every service at once, ignoring profiles and the
            # depends_on conditions: the services are named, and setup's completion is waited for here.
            run([*compose, "up", "--detach", "--no-build", "--no-deps", "setup"], env=env)
            setup_code = podman_output("wait", f"{project}_setup_1")
            figures["compose setup exit code"] = setup_code
            if setup_code != "0":
                raise RuntimeError(f"compose setup exited with code {setup_code}")
            figures["compose setup (s)"] = f"{time.monotonic() - started:.0f}"
            started = time.monotonic()
        run([*compose, "up", "--detach", "--no-build", "--no-deps", "api", "ui"], env=env)
        api = f"http://127.0.0.1:{api_port}"
        figures["compose API /readyz after up (s)"] = f"{wait_until(f'{api}/readyz', started):.1f}"
        gallery = workdir / "compose-query.jpg"
        # A photo of the demo gallery, read back from the setup step's volume through the API.
        first = httpx.get(f"{api}/v1/items", params={"limit": 1}, timeout=30).json()["items"][0]
        gallery.write_bytes(httpx.get(f"{api}/v1/items/{first['id']}/image", timeout=30).content)
        figures["compose API search results"] = str(search(api, gallery))
        health = f"http://127.0.0.1:{ui_port}/_stcore/health"
        figures["compose UI health after up (s)"] = f"{wait_until(health, started):.1f}"
        for service in ("api", "ui"):
            figures[f"compose {service} exit code after SIGTERM"] = str(
                stop_with_sigterm(f"{project}_{service}_1")
            )
    finally:
        subprocess.run([*compose, "down", "--volumes"], env=env, capture_output=True)
        # podman-compose 1.0 leaves the project's network behind.
        subprocess.run(["podman", "network", "rm", "--force", f"{project}_default"], capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--compose",
        choices=("serving", "full", "none"),
        default="serving",
        help="serving: compose's api and ui on the host's demo; full: also the train image and compose's "
        "setup step; none: no compose",
    )
    parser.add_argument("--rebuild-base", action="store_true", help="debootstrap the base even if it exists")
    args = parser.parse_args()
    figures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="dmlsearch-check-") as folder:
        workdir = Path(folder)
        (workdir / "containers.conf").write_text(CONTAINERS_CONF)
        os.environ["CONTAINERS_CONF"] = str(workdir / "containers.conf")
        try:
            gigabytes = FULL_GIGABYTES if args.compose == "full" else SERVING_GIGABYTES
            require_tools(args.compose != "none", gigabytes)
            figures["base image"] = ensure_base(args.rebuild_base)
            require_containers()
        except CannotRun as reason:
            print(f"cannot run the image check here: {reason}", flush=True)
            return 3
        except subprocess.CalledProcessError as err:  # podman itself fails before anything of ours is built
            output = err.stderr.strip()[-300:] if isinstance(err.stderr, str) else ""
            print(f"cannot run the image check here: {' '.join(err.cmd)} failed ({output})", flush=True)
            return 3
        figures["serving image build (s)"] = f"{build('serve', SERVE_TAG, workdir):.0f}"
        figures["serving image size (MB)"] = f"{image_megabytes(SERVE_TAG):.0f}"
        probe = ["podman", "run", "--rm", SERVE_TAG, "python", "-c", "import torch"]
        torch = subprocess.run(probe, capture_output=True)
        figures["torch in the serving image"] = "no" if torch.returncode else "yes"
        data, query = demo_data(workdir)
        check_api_and_ui(data, query, figures)
        if args.compose == "full":
            figures["train image build (s)"] = f"{build('train', TRAIN_TAG, workdir):.0f}"
            figures["train image size (MB)"] = f"{image_megabytes(TRAIN_TAG):.0f}"
        if args.compose != "none":
            check_compose(workdir, figures, host_demo=data if args.compose == "serving" else None)
    for name, value in figures.items():
        print(f"{name}: {value}")
    failed = [name for name, value in figures.items() if "exit code" in name and value != "0"]
    failed += [] if figures["torch in the serving image"] == "no" else ["torch in the serving image"]
    print("FAILED: " + ", ".join(failed) if failed else "OK", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
