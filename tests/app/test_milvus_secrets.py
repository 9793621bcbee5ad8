"""A secured Milvus (the real ``milvus-server`` with logins required, and with TLS): its credentials come from
the environment or a file, log in, and appear nowhere else: not in ``manifest.json``, the CLI's output, the
API's logs, its metrics, its answers while Milvus is up or its 503s while it is down (issue 42, finding 1).

The repro of the finding: ``build-index --milvus-uri http://root:PASSWORD@HOST:PORT``, ``serve``, stop
Milvus, ``curl /readyz``: the password was in the manifest and in the 503's body.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.lib.images import make_image
from bench.lib.servers import serving
from index.gallery import GalleryIndex
from index.protocol import BackendUnavailableError
from tests.support.milvus_server import MilvusServerProcess, running_milvus_server
from tests.tiers import starts

# Random per run: what is searched for cannot be in any output by chance, nor be another run's.
SECRET = f"S3cret-{os.urandom(6).hex()}"
SERVE = ["--rate-limit", "0"]


def _secure(server: MilvusServerProcess) -> None:
    """Give Milvus's first user, ``root``, the password :data:`SECRET`."""
    server.client().update_password("root", "Milvus", SECRET)
    server.token = f"root:{SECRET}"


@pytest.fixture
@starts("server")
def secured_milvus() -> Iterator[MilvusServerProcess]:
    """A Milvus server of this test's own that requires a login (user root, password SECRET)."""
    with running_milvus_server("dmlsearch-milvus-auth-", auth=True) as server:
        _secure(server)
        yield server


@pytest.fixture
def gallery(tmp_path: Path) -> Path:
    root = tmp_path / "gallery"
    (root / "a").mkdir(parents=True)
    for i in range(6):
        make_image(900 + i).save(root / "a" / f"{i}.png")
    return root


@pytest.fixture
def credentials(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that logs in as root: the user, and the password in a file."""
    password = tmp_path / "milvus-password"
    password.write_text(SECRET + "\n")
    password.chmod(0o600)
    return {"DMLSEARCH_MILVUS_USER": "root", "DMLSEARCH_MILVUS_PASSWORD_FILE": str(password)}


def _without_milvus_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("DMLSEARCH_MILVUS_")}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        env={**_without_milvus_environment(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _search(base: str, image: bytes) -> httpx.Response:
    return httpx.post(f"{base}/v1/search", params={"k": 1}, files={"image": ("q.png", image)}, timeout=60)


def _answers(base: str, image: bytes) -> dict[str, httpx.Response]:
    """Every kind of answer the API gives about its index, by what was asked."""
    gets = ["/readyz", "/healthz", "/metrics", "/v1/stats", "/v1/items?limit=5", "/v1/labels", "/v1/model"]
    answers = {path: httpx.get(f"{base}{path}", timeout=60) for path in gets}
    answers["POST /v1/search"] = _search(base, image)
    return answers


def _assert_nowhere(texts: dict[str, str]) -> None:
    """:data:`SECRET` is in none of ``texts`` (by where each came from)."""
    assert not [where for where, text in texts.items() if SECRET in text], "the Milvus password leaked"


def test_a_secured_milvus_password_appears_nowhere_while_milvus_is_up_or_down(
    secured_milvus: MilvusServerProcess,
    exported_model: Path,
    gallery: Path,
    credentials: dict[str, str],
    tmp_path: Path,
) -> None:
    server = secured_milvus
    in_uri = f"http://root:{SECRET}@127.0.0.1:{server.port}"
    index = tmp_path / "index"
    texts: dict[str, str] = {}

    # The finding's repro: the password inside --milvus-uri logs in, and is not recorded.
    model = ("--model", str(exported_model))
    built = _cli(
        "build-index",
        str(gallery),
        *model,
        "--out",
        str(index),
        "--backend",
        "milvus",
        "--milvus-uri",
        in_uri,
    )
    assert built.returncode == 0, built.stderr
    texts["build-index (URI)"] = built.stdout + built.stderr
    manifest = (index / "manifest.json").read_text()
    assert SECRET not in manifest, "manifest.json holds the password"
    assert f'"milvus_uri": "{server.uri}"' in manifest
    # From the environment (the password in a file), another build into the same collection: nothing new.
    again = _cli("build-index", str(gallery), *model, "--out", str(index), env=credentials)
    assert again.returncode == 0, again.stderr
    texts["build-index (environment)"] = again.stdout + again.stderr
    stats = _cli("index", "stats", str(index), env=credentials)
    assert stats.returncode == 0, stats.stderr
    texts["index stats"] = stats.stdout + stats.stderr

    # No credentials: refused, saying which variables to set.
    no = ("--out", str(tmp_path / "no"), "--backend", "milvus", "--milvus-uri", server.uri)
    refused = _cli("build-index", str(gallery), *model, *no)
    assert refused.returncode != 0
    assert "DMLSEARCH_MILVUS_USER" in refused.stderr, refused.stderr
    texts["build-index (no credentials)"] = refused.stdout + refused.stderr

    query = (gallery / "a" / "0.png").read_bytes()
    log = tmp_path / "serve.log"
    args = ["--index", str(index), "--model", str(exported_model), *SERVE]
    # Replica A logs in from the environment; replica B is given the password in --milvus-uri.
    with serving(args, credentials, log=log) as a, serving([*args, "--milvus-uri", in_uri], log=log) as b:
        for name, api in (("A", a), ("B", b)):
            up = _answers(api.url, query)
            assert up["POST /v1/search"].json()["results"][0]["path"] == "a/0.png"
            assert up["/readyz"].status_code == 200 and up["/metrics"].status_code == 200
            texts |= {f"{name} up {path}": answer.text for path, answer in up.items()}

        server.stop()
        for name, api in (("A", a), ("B", b)):
            down = _answers(api.url, query)
            assert down["/readyz"].status_code == 503 and down["POST /v1/search"].status_code == 503
            error = down["/readyz"].json()["error"]
            assert error["code"] == "index_unavailable" and f"Milvus at {server.uri}" in error["message"]
            texts |= {f"{name} down {path}": answer.text for path, answer in down.items()}
    texts["serve log"] = log.read_text(errors="replace")
    texts["manifest.json"] = (index / "manifest.json").read_text()
    _assert_nowhere(texts)


def test_an_index_whose_manifest_holds_the_password_opens_and_drops_it_at_its_next_save(
    secured_milvus: MilvusServerProcess,
    exported_model: Path,
    gallery: Path,
    credentials: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A manifest written before the fix recorded ``http://root:PASSWORD@HOST:PORT``."""
    from engine.build.indexing import build_index
    from engine.model.embedder import Embedder
    from index.connection import MilvusConnection

    server = secured_milvus
    for name in [name for name in os.environ if name.startswith("DMLSEARCH_MILVUS_")]:
        monkeypatch.delenv(name)
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    index = tmp_path / "index"
    build_index(
        gallery,
        Embedder(exported_model),
        index,
        progress=False,
        backend="milvus",
        milvus=MilvusConnection(server.uri),
    )
    for name in credentials:
        monkeypatch.delenv(name)
    path = index / "manifest.json"
    path.write_text(path.read_text().replace(server.uri, f"http://root:{SECRET}@127.0.0.1:{server.port}"))

    opened = GalleryIndex.open(index)  # no credentials in the environment: those the manifest holds
    assert len(opened) == 6
    opened.save()
    opened.close()
    assert SECRET not in path.read_text() and f'"milvus_uri": "{server.uri}"' in path.read_text()

    with pytest.raises(BackendUnavailableError) as refused:  # now the environment must give them
        GalleryIndex.open(index)
    assert "DMLSEARCH_MILVUS_USER" in str(refused.value) and SECRET not in str(refused.value)
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    reopened = GalleryIndex.open(index)
    assert len(reopened) == 6
    reopened.close()


@pytest.fixture
def certificates(tmp_path: Path) -> dict[str, Path]:
    """A CA and a server certificate it signed, for the name ``milvus.test`` and the address 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificates to serve TLS with")
    folder = tmp_path / "tls"
    folder.mkdir()
    files = {name: folder / name for name in ("ca.pem", "ca.key", "server.pem", "server.key", "server.csr")}
    (folder / "san.cnf").write_text("subjectAltName=DNS:milvus.test,IP:127.0.0.1\n")
    for command in (
        f"req -x509 -newkey rsa:2048 -nodes -keyout {files['ca.key']} -out {files['ca.pem']} -days 2 "
        "-subj /CN=dmlsearch-test-CA",
        f"req -newkey rsa:2048 -nodes -keyout {files['server.key']} -out {files['server.csr']} "
        "-subj /CN=milvus.test",
        f"x509 -req -in {files['server.csr']} -CA {files['ca.pem']} -CAkey {files['ca.key']} -CAcreateserial "
        f"-out {files['server.pem']} -days 2 -extfile {folder / 'san.cnf'}",
    ):
        subprocess.run(["openssl", *command.split()], check=True, capture_output=True, timeout=60)
    return files


@pytest.fixture
@starts("server")
def tls_milvus(certificates: dict[str, Path]) -> Iterator[MilvusServerProcess]:
    """A Milvus server that serves TLS only (``tlsMode`` 1) and requires a login."""
    tls = (certificates["server.pem"], certificates["server.key"])
    with running_milvus_server(
        "dmlsearch-milvus-tls-", auth=True, tls=tls, ca=certificates["ca.pem"]
    ) as server:
        _secure(server)
        yield server


def test_tls_with_a_ca_file_and_a_server_name(
    tls_milvus: MilvusServerProcess,
    certificates: dict[str, Path],
    exported_model: Path,
    gallery: Path,
    credentials: dict[str, str],
    tmp_path: Path,
) -> None:
    server = tls_milvus
    assert server.uri.startswith("https://")
    tls = {**credentials, "DMLSEARCH_MILVUS_CA_FILE": str(certificates["ca.pem"])}
    index = tmp_path / "index"
    args = ("--model", str(exported_model), "--out", str(index), "--backend", "milvus")
    built = _cli("build-index", str(gallery), *args, "--milvus-uri", server.uri, env=tls)
    assert built.returncode == 0, built.stderr
    assert SECRET not in built.stdout + built.stderr + (index / "manifest.json").read_text()
    # The certificate's name instead of the address it is reached at.
    named = _cli("index", "stats", str(index), env={**tls, "DMLSEARCH_MILVUS_SERVER_NAME": "milvus.test"})
    assert named.returncode == 0, named.stderr

    # Without the CA the server's certificate is not trusted; plain http to a TLS port is refused too.
    untrusted = _cli("index", "stats", str(index), env=credentials)
    assert untrusted.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, untrusted.stderr
    assert "DMLSEARCH_MILVUS_CA_FILE" in untrusted.stderr
    wrong_name = _cli("index", "stats", str(index), env={**tls, "DMLSEARCH_MILVUS_SERVER_NAME": "other.test"})
    assert wrong_name.returncode != 0
    plain = _cli(
        "index", "stats", str(index), env={**credentials, "DMLSEARCH_MILVUS_CA_FILE": "/etc/hostname"}
    )
    assert plain.returncode != 0
    _assert_nowhere({"untrusted": untrusted.stderr, "wrong name": wrong_name.stderr})
