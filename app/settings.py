"""All server settings in one place, from ``DMLSEARCH_*`` environment variables or CLI flags.

Each field is one setting: ``dmlsearch serve`` generates a flag for every field from its name, type,
default and description (cli/settings_flags.py), so a new field needs no CLI code. Defaults shared with the
engine and the CLI come from ``foundation.defaults``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from foundation import defaults
from foundation.families import Backend

# What the settings make, imported where they are made: `dmlsearch` reads these settings for its flags
# without loading the server (FastAPI) or the decoder (Pillow).
if TYPE_CHECKING:
    from app.clients import Clients
    from app.middleware import BodyPace
    from engine.decode.pool import DecodeLimits
    from index.connection import MilvusConnection


class Settings(BaseSettings):
    # An empty variable (DMLSEARCH_MODEL_PATH= in a compose file or .env) means "not set", not the path ".".
    model_config = SettingsConfigDict(
        env_prefix="DMLSEARCH_", env_file=".env", extra="ignore", env_ignore_empty=True
    )

    index_path: Path = Field(defaults.INDEX_PATH, description="index directory to serve")
    model_path: Path | None = Field(
        None, description="model.onnx to embed queries with (default: the model the index carries)"
    )
    backend: Backend | None = Field(None, description="expected index backend")
    milvus_uri: str | None = Field(
        None,
        description="reach the index's Milvus collection here instead (credentials and TLS: "
        "DMLSEARCH_MILVUS_USER, _PASSWORD, _TOKEN, _CA_FILE; docs/milvus.md)",
    )
    threads: int = Field(0, ge=0, description="onnxruntime intra-op threads (0 = all cores)")
    compute_slots: int = Field(
        0, ge=0, description="queries decoded and embedded at once; more wait in line (0 = one per CPU core)"
    )
    client_compute_slots: int = Field(
        0,
        ge=0,
        description="of those, the most one client (an API key, or an address) holds at once; its other "
        "queries wait for its own to end, never for another client's (0 = half of compute_slots, at least "
        "one)",
    )
    compute_quantum_seconds: float = Field(
        defaults.COMPUTE_QUANTUM_SECONDS,
        gt=0,
        description="a query that has held its compute slot this long while another client waits gives it up "
        "and goes on in the background, its decodes at the lowest CPU priority (as many in the background as "
        "compute_slots)",
    )
    client_ipv4_prefix: int = Field(
        defaults.CLIENT_IPV4_PREFIX,
        ge=0,
        le=32,
        description="IPv4 addresses in one network this wide (prefix bits) are one client, for the rate "
        "limit and the compute slots' fair share",
    )
    client_ipv6_prefix: int = Field(
        defaults.CLIENT_IPV6_PREFIX,
        ge=0,
        le=128,
        description="IPv6 addresses in one network this wide (prefix bits) are one client: a /64 by default, "
        "the least one host is given, so that its many addresses do not count as many clients",
    )
    api_key: SecretStr | None = Field(
        None,
        description="X-API-Key required by POST/DELETE /v1/items and POST /v1/admin/reload; both are "
        "disabled when unset",
    )
    max_upload_bytes: int = Field(20 * 1024 * 1024, gt=0, description="largest single image")
    max_request_bytes: int = Field(
        64 * 1024 * 1024, gt=0, description="largest request body (a batch, base64 inflates by 4/3)"
    )
    max_image_pixels: int = Field(
        defaults.MAX_IMAGE_PIXELS, gt=0, description="refuse images with more pixels"
    )
    max_batch_pixels: int = Field(
        defaults.MAX_BATCH_PIXELS,
        gt=0,
        description="refuse requests whose images decode to more pixels in all (413, read from the headers "
        "before any image is decoded; JPEGs count at the reduced size they are decoded at)",
    )
    max_k: int = Field(defaults.MAX_K, ge=1, le=defaults.MAX_K, description="largest k a client may ask for")
    max_offset: int = Field(10_000, ge=0, description="largest offset (paging) a client may ask for")
    max_batch: int = Field(64, ge=1, description="most images in one batch search or add")
    decode_cpu_seconds: float = Field(
        defaults.DECODE_CPU_SECONDS,
        gt=0,
        description="CPU seconds decoding one image may take; past it the image is refused (422 "
        "image_too_costly)",
    )
    decode_wall_seconds: float = Field(
        defaults.DECODE_WALL_SECONDS,
        gt=0,
        description="wall-clock time decoding one image may take (its CPU is shared); past it, 422 as well",
    )
    decode_request_cpu_seconds: float = Field(
        defaults.DECODE_REQUEST_CPU_SECONDS,
        gt=0,
        description="CPU seconds decoding all the images of one request may take together; past it the "
        "request is cut off at the image that ran out (422 request_too_costly, naming it)",
    )
    decode_request_wall_seconds: float = Field(
        defaults.DECODE_REQUEST_WALL_SECONDS,
        gt=0,
        description="wall-clock time decoding all the images of one request may take together; past it, "
        "422 request_too_costly as well",
    )
    embed_run_seconds: float = Field(
        defaults.EMBED_RUN_SECONDS,
        gt=0,
        description="wall-clock time one model run (a few images, already at the model's input size) may "
        "take before it is stopped: 503 embed_timeout, the server's state (load, a slow model), not the "
        "request's",
    )
    decode_memory_mb: int = Field(
        defaults.DECODE_MEMORY_BYTES // 1024**2,
        ge=64,
        description="memory decoding one image may allocate, in a decode process's address-space limit "
        "(what the decoder really takes, not what the header declares); past it, 422 as well",
    )
    jpeg_draft: bool = Field(
        defaults.JPEG_DRAFT, description="decode large JPEGs at reduced DCT scale (much faster)"
    )
    rerank_pool: int = Field(
        defaults.RERANK_POOL,
        ge=1,
        le=10_000,
        description="rerank=pddm re-scores the top max(rerank_pool, 4k) cosine neighbours with the PDDM unit",
    )
    vote_sigma2: float = Field(
        defaults.VOTE_SIGMA2,
        gt=0,
        description="sigma^2 of the predict=true vote: neighbour weight exp(-|q-x|^2/2sigma^2)",
    )
    index_deadline_seconds: float = Field(
        defaults.INDEX_DEADLINE_SECONDS,
        ge=0,
        description="a request's calls to the index server (Milvus) take this long in all, counted from the "
        "first; past it the request gets 503 index_unavailable with Retry-After (0 = each call its own "
        "limit only)",
    )
    index_poll_seconds: float = Field(
        2.0,
        ge=0,
        description="check this often whether another process (dmlsearch watch, build-index) saved the "
        "index, and reload it (0 = never)",
    )
    wait_for_index: bool = Field(
        False,
        description="start even when there is no index to serve (no such directory, not an index, its model "
        "missing or not the index's): stay up not ready (503 not_ready) and load it once its directory "
        "changes, checked every index_poll_seconds (a replica whose index is copied in later); without "
        "this, serve exits 2 with the reason",
    )
    reload_probe_seconds: float = Field(
        30.0,
        gt=0,
        description="a reloaded model must embed a probe image within this (in a child process, killed "
        "after it), or the reload is refused",
    )
    rate_limit_per_second: float = Field(
        20.0, ge=0, description="sustained requests per second per client on /v1 (0 disables limiting)"
    )
    rate_limit_burst: int = Field(100, ge=1, description="requests a client may make at once")
    shutdown_grace_seconds: float = Field(
        10.0,
        ge=0,
        description="on SIGTERM/SIGINT, requests in flight get this long to finish before their connections "
        "are closed",
    )
    header_timeout_seconds: float = Field(
        10.0, ge=0, description="close a connection whose request headers take longer (408; 0 = no limit)"
    )
    body_timeout_seconds: float = Field(
        30.0,
        ge=0,
        description="close an upload whose body pauses longer between chunks, or falls this far behind "
        "min_upload_bytes_per_second (408; 0 = no limit)",
    )
    min_upload_bytes_per_second: int = Field(
        16 * 1024,
        ge=0,
        description="the slowest a request body may arrive on average (128 kbit/s): behind it by "
        "body_timeout_seconds, or holding an upload slot that a new upload needs, it gets 408 and is "
        "closed (0 = no minimum)",
    )
    body_deadline_seconds: float = Field(
        120.0,
        ge=0,
        description="close an upload whose whole body has not arrived this long after its headers, however "
        "fast it comes (408; 0 = no limit)",
    )
    keep_alive_seconds: int = Field(
        15,
        ge=1,
        description="close idle keep-alive connections after this long (behind a proxy: longer than the "
        "proxy's upstream idle timeout)",
    )
    max_connections: int = Field(
        512, ge=0, description="open connections beyond this are answered 503 with Retry-After (0 = no cap)"
    )
    max_concurrent_uploads: int = Field(
        8,
        ge=1,
        description="requests with a body received at once (each buffers up to max_request_bytes); more are "
        "answered 503 with Retry-After",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="origins allowed by CORS, comma-separated in the environment"
    )
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="addresses or networks of reverse proxies whose X-Forwarded-For/-Proto headers are "
        "believed (the client address rate limits use), comma-separated in the environment; none by "
        "default: then those headers are ignored, since any client can send them",
    )

    @field_validator("cors_origins", "trusted_proxies", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            return [origin.strip() for origin in value.split(",") if origin.strip()]
        return value

    @property
    def milvus(self) -> MilvusConnection:
        """How to reach the served index's Milvus collection where it is not where the index recorded."""
        from index.connection import MilvusConnection

        return MilvusConnection(uri=self.milvus_uri)

    def clients(self) -> Clients:
        """How requests are told apart, for the rate limit and the compute slots."""
        from app.clients import Clients

        return Clients(self.write_key, self.client_ipv4_prefix, self.client_ipv6_prefix)

    def body_pace(self) -> BodyPace:
        from app.middleware import BodyPace

        return BodyPace(
            self.min_upload_bytes_per_second, self.body_timeout_seconds, self.body_deadline_seconds
        )

    def decode_limits(self) -> DecodeLimits:
        from engine.decode.pool import DecodeLimits

        memory = self.decode_memory_mb * 1024**2
        return DecodeLimits(
            self.decode_cpu_seconds,
            self.decode_wall_seconds,
            memory,
            self.decode_request_cpu_seconds,
            self.decode_request_wall_seconds,
        )

    @property
    def write_key(self) -> str | None:
        """The key writes need; None when writes are off (no key, or an empty one)."""
        return (self.api_key.get_secret_value() if self.api_key is not None else "") or None

    @property
    def writes_enabled(self) -> bool:
        return self.write_key is not None
