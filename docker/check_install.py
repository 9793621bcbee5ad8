"""Run a Dockerfile's build steps in a fresh virtualenv, for machines without a container engine.

    python docker/check_install.py docker/Dockerfile --serve \
        --build-arg TORCH_INDEX_URL=https://pypi.org/simple

The Dockerfile itself is parsed (dockerfile-parse), so the commands run here are the image's commands, not
a retyped copy. Each container path (/src, /opt, /data, /home) maps to a folder under ``--root``; the base
image's Python is a fresh virtualenv (python:X.Y images) or a chosen interpreter where the image installs
Python through apt. Steps that only make sense as root inside an image (apt-get, useradd, chown) are skipped
and listed. With ``--serve``, the compose file's ``setup`` command builds the demo model and index, and the
image's CMD is started and must answer ``/readyz`` with 200, then stop cleanly on SIGTERM.
Exit code 0 means every executed step succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import venv
from pathlib import Path

import yaml
from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[1]
# Top-level container folders the Dockerfiles write to; each maps to ROOT/<name>.
CONTAINER_DIRS = ("src", "opt", "data", "home")
# Shell commands that need root inside an image; everything else a RUN does is executed.
SKIPPED_COMMANDS = {
    "apt-get": "system packages: Debian's own here (libgomp1, curl and python3 are present)",
    "useradd": "creates the image's unprivileged user",
    "chown": "hands /data to the image's user",
}
# Python of base images that install it through apt (the python:X.Y images bring their own).
APT_PYTHON = {"ubuntu24.04": "python3.12"}


def container_to_host(text: str, root: Path) -> str:
    pattern = r"(?<![\w:/.])/(" + "|".join(CONTAINER_DIRS) + r")\b"
    return re.sub(pattern, lambda m: f"{root}/{m.group(1)}", text)


def base_python(base_image: str, override: str | None) -> tuple[str, bool]:
    """(interpreter, whether the image's own Python is a python:X.Y image that we emulate with a venv)."""
    if override:
        return override, base_image.startswith("python:")
    match = re.match(r"python:(\d+\.\d+)", base_image)
    if match:
        return f"python{match.group(1)}", True
    for suffix, interpreter in APT_PYTHON.items():
        if base_image.endswith(suffix):
            return interpreter, False
    raise SystemExit(f"unknown base image {base_image!r}: pass --python")


def split_segments(command: str) -> list[str]:
    return [part.strip() for part in re.split(r"\s&&\s", command) if part.strip()]


def skip_reason(segment: str) -> str | None:
    words = shlex.split(segment)
    if words[0] in SKIPPED_COMMANDS:
        return SKIPPED_COMMANDS[words[0]]
    if words[:2] == ["rm", "-rf"] and all(w.startswith("/var/lib/apt") for w in words[2:]):
        return "apt cache of the image"
    return None


def resolve(command: list[str], env: dict[str, str]) -> list[str]:
    """The command with its program looked up on the emulated image's PATH."""
    return [shutil.which(command[0], path=env["PATH"]) or command[0], *command[1:]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Build:
    """The state a Dockerfile's instructions act on: working directory, environment, build arguments."""

    def __init__(
        self,
        root: Path,
        python: str,
        emulate_python_image: bool,
        build_args: dict[str, str],
        dry_run: bool = False,
    ):
        self.root = root
        self.dry_run = dry_run
        self.executed: list[str] = []
        self.env = dict(os.environ)
        self.build_args = build_args
        self.cwd = root
        self.cmd: list[str] = []
        self.skipped: list[str] = []
        shims = root / "base" / "bin"
        self.env["PATH"] = f"{shims}:{self.env['PATH']}"
        if dry_run:
            return
        if emulate_python_image:
            # python:X.Y images: pip installs into the image's own Python, emulated by a venv.
            venv.EnvBuilder(with_pip=True).create(root / "base")
            subprocess.run([shims / "python", "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        else:
            shims.mkdir(parents=True)
            # The interpreter's real path: a version manager's shim would pick its version by the link's name.
            probe = subprocess.run(
                [python, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True
            )
            if probe.returncode:
                raise SystemExit(f"{python} does not run here ({probe.stderr.strip()}): pass --python PATH")
            (shims / "python3").symlink_to(probe.stdout.strip())

    def expand(self, text: str) -> str:
        """Docker's substitution of ARG and ENV values (ENV, WORKDIR, COPY; RUN leaves it to the shell)."""
        known = {**self.env, **self.build_args}
        text = container_to_host(text, self.root)
        return re.sub(r"\$\{?(\w+)\}?", lambda m: known.get(m.group(1), m.group(0)), text)

    def apply(self, instruction: str, value: str) -> None:
        getattr(self, f"on_{instruction.lower()}", self.on_other)(instruction, value)

    def on_env(self, _: str, value: str) -> None:
        for pair in shlex.split(value):
            key, _, raw = pair.partition("=")
            self.env[key] = self.expand(raw)

    def on_arg(self, _: str, value: str) -> None:
        key, _, default = value.partition("=")
        self.build_args.setdefault(key, default)

    def on_workdir(self, _: str, value: str) -> None:
        self.cwd = Path(self.expand(value))
        if not self.dry_run:
            self.cwd.mkdir(parents=True, exist_ok=True)

    def on_copy(self, _: str, value: str) -> None:
        *sources, target = shlex.split(value)
        if self.dry_run:
            return
        destination = self.cwd / self.expand(target)
        for source in sources:
            path = REPO / source
            if path.is_dir():
                shutil.copytree(path, destination, dirs_exist_ok=True)
            else:
                destination.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, destination / path.name)

    def on_run(self, _: str, value: str) -> None:
        kept = []
        for segment in split_segments(value):
            reason = skip_reason(segment)
            if reason:
                self.skipped.append(f"{segment.split()[0]} ({reason})")
            else:
                kept.append(container_to_host(segment, self.root))
        if not kept:
            return
        command = " && ".join(kept)
        self.executed.append(command)
        print(f"RUN {command}", flush=True)
        if self.dry_run:
            return
        # Build arguments are environment variables of RUN steps, as in docker build.
        env = {**self.env, **self.build_args}
        subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=self.cwd, env=env, check=True)

    def on_cmd(self, _: str, value: str) -> None:
        self.cmd = json.loads(value)

    def on_other(self, instruction: str, value: str) -> None:
        if instruction not in {"COMMENT", "FROM", "USER", "VOLUME", "EXPOSE", "LABEL"}:
            raise SystemExit(f"unsupported instruction {instruction} {value}")


def serve_check(build: Build) -> None:
    """The compose file's setup step, then the image's CMD until /readyz answers 200, then SIGTERM."""
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    setup = [build.expand(word) for word in compose["services"]["setup"]["command"]]
    print(f"setup: {' '.join(setup)}", flush=True)
    subprocess.run(resolve(setup, build.env), cwd=build.cwd, env=build.env, check=True)
    port = free_port()
    command = [build.expand(word) for word in build.cmd] + ["--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(resolve(command, build.env), cwd=build.cwd, env=build.env)
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                raise SystemExit(f"CMD exited with code {server.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("CMD never answered /readyz with 200")
            time.sleep(0.5)
        print(f"CMD answered /readyz 200 on port {port}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        print(f"CMD exited with code {code} after SIGTERM", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dockerfile", type=Path)
    parser.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--python", help="interpreter standing in for the base image's Python")
    parser.add_argument("--root", type=Path, help="folder for the emulated image (default: a new temp dir)")
    parser.add_argument("--serve", action="store_true", help="also run the compose setup step and the CMD")
    parser.add_argument("--dry-run", action="store_true", help="print the steps without running them")
    args = parser.parse_args()

    dockerfile = DockerfileParser(fileobj=args.dockerfile.open("rb"))
    python, emulate = base_python(dockerfile.baseimage, args.python)
    root = args.root or Path(tempfile.mkdtemp(prefix="dmlsearch-image-"))
    build_args = dict(arg.split("=", 1) for arg in args.build_arg)
    print(f"{args.dockerfile}: base {dockerfile.baseimage}, Python {python}, root {root}", flush=True)
    build = Build(root, python, emulate, build_args, dry_run=args.dry_run)
    for item in dockerfile.structure:
        build.apply(item["instruction"], item["value"])
    skipped = ", ".join(build.skipped) or "none"
    print(f"{len(build.executed)} RUN steps executed; skipped: {skipped}", flush=True)
    if args.dry_run:
        return 0
    help_command = resolve(["dmlsearch", "--help"], build.env)
    subprocess.run(help_command, env=build.env, check=True, stdout=subprocess.DEVNULL)
    if args.serve:
        serve_check(build)
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
