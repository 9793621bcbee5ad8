"""HTTP routes, thin wrappers over the jobs of :class:`engine.serve.search.SearchService`."""

from __future__ import annotations

from fastapi import APIRouter

from app.routes import admin, duplicates, explain, feedback, health, items, model, search

router = APIRouter()
for module in (health, search, explain, items, feedback, duplicates, admin, model):
    router.include_router(module.router)
