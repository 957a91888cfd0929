"""One APIRouter per resource; `create_app` includes them in this order under ``/v1``.

The order is the OpenAPI order and, within a module, the match order (a
catch-all route such as ``/steps/{step_ref}`` comes after the one it guards).
"""

from __future__ import annotations

from fastapi import APIRouter

from . import bundles, diff, health, queries, replay, runs, steps

ROUTERS: tuple[APIRouter, ...] = (
    health.router,
    runs.router,
    steps.router,
    bundles.router,
    replay.router,
    queries.router,
    diff.router,
)
