"""All server settings in one place, from ``DMLSEARCH_*`` environment variables or CLI flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DMLSEARCH_", env_file=".env", extra="ignore")

    index_path: Path = Path("artifacts/index")
    model_path: Path = Path("artifacts/model/model.onnx")
    threads: int = Field(0, ge=0, description="onnxruntime intra-op threads (0 = all cores)")
    max_upload_bytes: int = Field(20 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field(50_000_000, gt=0)
    max_k: int = Field(100, ge=1)
    cors_origins: list[str] = Field(default_factory=list)
