"""What logging in to a Milvus server takes (a user and password, or a token) and how its TLS is checked:
read from ``DMLSEARCH_MILVUS_*`` environment variables (or ``.env``) and the files they name, never from
anything an index records, and kept out of every message.

An index's manifest records where its collection is (``index.connection.MilvusConnection``), which anyone
who can read the index directory reads: a URI that carries ``user:password@`` is used to log in but never
recorded (:func:`public_uri`), and messages that name the server name it so. A manifest written before
(one that holds such a URI) still opens with it; its next save drops the credentials.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from foundation.errors import InvalidInputError
from foundation.regular_files import read_regular

ENV_PREFIX = "DMLSEARCH_MILVUS_"
SECRET_FILE_BYTES = 64 * 1024  # a password or token file, or a CA bundle, is far smaller
REDACTED = "***"


def public_uri(uri: str) -> str:
    """``uri`` without the user and password it may carry (``http://user:pw@host:19530`` gives
    ``http://host:19530``): what is recorded and shown. A Milvus Lite path is returned as it is."""
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def uri_secrets(uri: str | None) -> list[str]:
    """The password or token a URI carries in its user part (``user:password@`` or ``token@``)."""
    if uri is None or "://" not in uri:
        return []
    userinfo, at, _ = urlsplit(uri).netloc.rpartition("@")
    if not at:
        return []
    user, _, password = userinfo.partition(":")
    return [secret for secret in (password or user, userinfo) if secret]


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every one of ``secrets`` in it replaced, longest first (a password inside its
    ``user:password`` token is replaced with the token)."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def _read_secret(path: Path, variable: str) -> str:
    try:
        value = read_regular(path, SECRET_FILE_BYTES).decode().strip()
    except UnicodeDecodeError:  # its message quotes the file's bytes
        raise InvalidInputError(f"{variable}: cannot read {path}: not UTF-8 text") from None
    except (OSError, InvalidInputError) as err:  # a missing file, a FIFO or device, one too large
        raise InvalidInputError(f"{variable}: cannot read {path}: {err}") from err
    if not value:
        raise InvalidInputError(f"{variable}: {path} is empty")
    return value


class MilvusAccess(BaseSettings):
    """Credentials and TLS for a Milvus server, from the environment only (no command-line flag: a
    password there is in every process listing). A user needs a password; a token (Zilliz Cloud's API key,
    or ``user:password``) stands alone. ``*_FILE`` reads the secret from a file (a Docker or Kubernetes
    secret), the whole file, surrounding whitespace dropped."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_file=".env", extra="ignore", env_ignore_empty=True
    )

    user: str | None = None
    password: SecretStr | None = None
    password_file: Path | None = None
    token: SecretStr | None = None
    token_file: Path | None = None
    # TLS: an https:// URI is always checked; against these CA certificates (PEM) instead of the system's,
    # and under this name instead of the URI's host (a certificate made for a name, reached by address).
    ca_file: Path | None = None
    server_name: str | None = None

    def _secret(self, name: str) -> str | None:
        value: SecretStr | None = getattr(self, name)
        path: Path | None = getattr(self, f"{name}_file")
        variable = f"{ENV_PREFIX}{name.upper()}"
        if value is not None and path is not None:
            raise InvalidInputError(f"set {variable} or {variable}_FILE, not both")
        if path is not None:
            return _read_secret(path, f"{variable}_FILE")
        return value.get_secret_value() if value is not None else None

    def login_token(self) -> str | None:
        """What pymilvus logs in with: ``user:password``, the token, or None (no credentials given here)."""
        password, token = self._secret("password"), self._secret("token")
        if token is not None and (self.user is not None or password is not None):
            raise InvalidInputError(
                f"set either {ENV_PREFIX}TOKEN or {ENV_PREFIX}USER and {ENV_PREFIX}PASSWORD, not both"
            )
        if (self.user is None) != (password is None):
            raise InvalidInputError(f"{ENV_PREFIX}USER and {ENV_PREFIX}PASSWORD go together: set both")
        return token if token is not None else (f"{self.user}:{password}" if password is not None else None)

    def client_options(self, uri: str) -> dict[str, object]:
        """``pymilvus.MilvusClient`` keyword arguments to reach ``uri`` with (its credentials and TLS)."""
        options: dict[str, object] = {}
        if (token := self.login_token()) is not None:
            options["token"] = token
        tls = {"ca_file": self.ca_file, "server_name": self.server_name}
        if any(value is not None for value in tls.values()) and not uri.startswith("https://"):
            given = ", ".join(
                f"{ENV_PREFIX}{name.upper()}" for name, value in tls.items() if value is not None
            )
            raise InvalidInputError(f"{given} set, but {public_uri(uri)} is not an https:// URI")
        if self.ca_file is not None:  # pymilvus's name for the CA a server's certificate is checked against
            options["server_pem_path"] = str(self.ca_file)
            if not self.ca_file.is_file():
                raise InvalidInputError(f"{ENV_PREFIX}CA_FILE: {self.ca_file} is not a file")
        if self.server_name is not None:
            options["server_name"] = self.server_name
        return options
