"""docker/compose.yaml: the photos an index is built from are where the API serves them from."""

from __future__ import annotations

from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"


def test_every_dmlsearch_service_mounts_the_photos_at_the_same_path() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    for name in ("setup", "api", "ui", "index-milvus"):
        volumes = compose["services"][name]["volumes"]
        assert "${DMLSEARCH_PHOTOS:-photos}:/photos:ro" in volumes, name
        assert "artifacts:/data" in volumes, name
    assert "photos" in compose["volumes"]  # what is mounted when DMLSEARCH_PHOTOS is unset


def test_setup_runs_the_train_image_and_the_servers_the_serving_image() -> None:
    """Only `setup` exports a model, which needs torch; the API and the UI run the image without it."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["setup"]["build"]["target"] == "train"
    for name in ("api", "ui", "index-milvus"):
        assert services[name]["build"]["target"] == "serve", name
        assert services[name]["image"] == "dmlsearch:cpu", name
