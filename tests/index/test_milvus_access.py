"""Milvus credentials and TLS come from the environment and the files it names, reach pymilvus as its
options, and never reach a manifest or a message (issue 42, finding 1). The real server's side, a login
it requires and TLS it serves: tests/app/test_milvus_secrets.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundation.errors import InvalidInputError
from index.connection import MilvusConnection
from index.manifest import Manifest
from index.milvus_access import MilvusAccess, public_uri, redact, uri_secrets

SECRET = "S3cret-Pass"


@pytest.fixture(autouse=True)
def _no_milvus_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Only what a test sets: no DMLSEARCH_MILVUS_* of the machine, no .env of the working folder."""
    for name in ("USER", "PASSWORD", "PASSWORD_FILE", "TOKEN", "TOKEN_FILE", "CA_FILE", "SERVER_NAME"):
        monkeypatch.delenv(f"DMLSEARCH_MILVUS_{name}", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(
    ("uri", "public"),
    [
        (f"http://root:{SECRET}@milvus.example:19530", "http://milvus.example:19530"),
        (f"https://{SECRET}@in01.zillizcloud.com:443/db1", "https://in01.zillizcloud.com:443/db1"),
        ("http://127.0.0.1:19530", "http://127.0.0.1:19530"),
        ("/srv/index/milvus.db", "/srv/index/milvus.db"),
    ],
)
def test_a_public_uri_has_no_credentials(uri: str, public: str) -> None:
    assert public_uri(uri) == public
    assert SECRET not in redact(f"Milvus at {uri}: refused", uri_secrets(uri))


def test_a_manifest_never_writes_the_credentials_of_its_uri(tmp_path: Path) -> None:
    uri = f"http://root:{SECRET}@milvus.example:19530"
    manifest = Manifest(dim=4, model_fingerprint="f", created="c", updated="u", milvus_uri=uri)
    assert manifest.milvus.uri == uri  # a manifest written before still logs in with them
    manifest.save(tmp_path)
    written = (tmp_path / "manifest.json").read_text()
    assert SECRET not in written and '"milvus_uri": "http://milvus.example:19530"' in written
    assert SECRET not in str(manifest.model_dump()) and SECRET not in repr(manifest.milvus)
    assert Manifest.load(tmp_path).milvus == MilvusConnection("http://milvus.example:19530")


def test_user_and_password_or_a_token_from_the_environment_or_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    uri = "https://milvus.example:19530"
    assert MilvusAccess().client_options(uri) == {}
    monkeypatch.setenv("DMLSEARCH_MILVUS_USER", "dml")
    monkeypatch.setenv("DMLSEARCH_MILVUS_PASSWORD", SECRET)
    assert MilvusAccess().client_options(uri) == {"token": f"dml:{SECRET}"}
    assert SECRET not in repr(MilvusAccess())
    monkeypatch.delenv("DMLSEARCH_MILVUS_PASSWORD")
    secret_file = tmp_path / "password"
    secret_file.write_text(f"{SECRET}\n")
    monkeypatch.setenv("DMLSEARCH_MILVUS_PASSWORD_FILE", str(secret_file))
    assert MilvusAccess().client_options(uri) == {"token": f"dml:{SECRET}"}
    monkeypatch.delenv("DMLSEARCH_MILVUS_USER")
    monkeypatch.delenv("DMLSEARCH_MILVUS_PASSWORD_FILE")
    monkeypatch.setenv("DMLSEARCH_MILVUS_TOKEN_FILE", str(secret_file))
    assert MilvusAccess().client_options(uri) == {"token": SECRET}


def test_a_dotenv_file_gives_them_too(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(f"DMLSEARCH_MILVUS_TOKEN={SECRET}\n")
    assert MilvusAccess().client_options("http://h:19530") == {"token": SECRET}


@pytest.mark.parametrize(
    ("environment", "says"),
    [
        ({"USER": "dml"}, "go together"),
        ({"PASSWORD": SECRET}, "go together"),
        ({"TOKEN": SECRET, "USER": "dml", "PASSWORD": SECRET}, "not both"),
        ({"PASSWORD": SECRET, "PASSWORD_FILE": "/etc/hostname", "USER": "dml"}, "not both"),
        ({"TOKEN_FILE": "/nonexistent/token"}, "cannot read"),
        ({"TOKEN_FILE": "/dev/null"}, "cannot read"),  # not a regular file
        ({"CA_FILE": "/nonexistent/ca.pem"}, "not a file"),
    ],
)
def test_settings_that_cannot_work_are_refused_without_the_secret(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], says: str
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(f"DMLSEARCH_MILVUS_{name}", value)
    with pytest.raises(InvalidInputError, match=says) as refused:
        MilvusAccess().client_options("https://milvus.example:19530")
    assert SECRET not in str(refused.value)


def test_tls_options_reach_pymilvus_and_need_an_https_uri(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("DMLSEARCH_MILVUS_CA_FILE", str(ca))
    monkeypatch.setenv("DMLSEARCH_MILVUS_SERVER_NAME", "milvus.internal")
    options = MilvusAccess().client_options("https://10.0.0.5:19530")
    assert options == {"server_pem_path": str(ca), "server_name": "milvus.internal"}
    with pytest.raises(InvalidInputError, match="not an https:// URI"):
        MilvusAccess().client_options("http://10.0.0.5:19530")
