"""OpenAPI links: how one answer's ids feed the next request (docs/rest.md#links).

A client (or a stateful fuzzer: tests/test_api_schema.py runs Schemathesis's
stateful phase over them) can walk from the list of runs to a run's steps,
a step, its bundles, their samples and payload bytes, and a replay of the
bundle, with every id taken from the previous response. FastAPI has no
decorator argument for links that can name the target's generated
operationId, so they are declared here by (method, path) and written into
the schema once it is generated.
"""

from __future__ import annotations

from typing import Any

RUNS = ("get", "/v1/runs")
SUMMARY = ("get", "/v1/runs/{run}/summary")
STRIP = ("get", "/v1/runs/{run}/strip")
STEPS = ("get", "/v1/runs/{run}/steps")
STEP = ("get", "/v1/runs/{run}/steps/{rollout_id}:{step_id}")
RESULT = ("get", "/v1/runs/{run}/steps/{rollout_id}:{step_id}/result")
ROLLOUT = ("get", "/v1/runs/{run}/rollouts/{rollout_id}")
BUNDLE = ("get", "/v1/bundles/{key}")
SAMPLES = ("get", "/v1/bundles/{key}/samples")
PAYLOAD = ("get", "/v1/bundles/{key}/payloads/{name}")
REPLAY = ("post", "/v1/replay")
MISMATCH = ("get", "/v1/runs/{run}/mismatch")
MISMATCH_LAYERS = ("get", "/v1/runs/{run}/mismatch/layers")

_FIRST_RUN = "$response.body#/items/0/run"
_FIRST_STEP = {
    "run": "$request.path.run",
    "rollout_id": "$response.body#/items/0/rollout_id",
    "step_id": "$response.body#/items/0/step_id",
}
_DETAIL_BUNDLE = "$response.body#/bundles/0/key"

#: (source operation, link name, target operation, parameters, request body)
LINKS: tuple[tuple[tuple[str, str], str, tuple[str, str], dict[str, str], Any], ...] = (
    (RUNS, "RunSummary", SUMMARY, {"run": _FIRST_RUN}, None),
    (RUNS, "RunStrip", STRIP, {"run": _FIRST_RUN}, None),
    (RUNS, "RunSteps", STEPS, {"run": _FIRST_RUN}, None),
    (RUNS, "RunMismatch", MISMATCH, {"run": _FIRST_RUN}, None),
    (RUNS, "RunMismatchLayers", MISMATCH_LAYERS, {"run": _FIRST_RUN}, None),
    (MISMATCH, "MismatchStep", STEP, _FIRST_STEP, None),
    (
        MISMATCH,
        "WorstTokenBundle",
        BUNDLE,
        {"key": "$response.body#/items/0/worst/bundle_key"},
        None,
    ),
    (STEPS, "Step", STEP, _FIRST_STEP, None),
    (STEPS, "StepResult", RESULT, _FIRST_STEP, None),
    (
        STEPS,
        "Rollout",
        ROLLOUT,
        {"run": "$request.path.run", "rollout_id": "$response.body#/items/0/rollout_id"},
        None,
    ),
    (STEP, "FirstBundle", BUNDLE, {"key": _DETAIL_BUNDLE}, None),
    (STEP, "FirstBundleSamples", SAMPLES, {"key": _DETAIL_BUNDLE}, None),
    (
        STEP,
        "FirstPayload",
        PAYLOAD,
        {"key": _DETAIL_BUNDLE, "name": "$response.body#/bundles/0/payloads/0/name"},
        None,
    ),
    (STEP, "ReplayFirstBundle", REPLAY, {}, {"bundle": _DETAIL_BUNDLE, "stage": "all"}),
    (
        ROLLOUT,
        "FirstStepOfRollout",
        STEP,
        {
            "run": "$request.path.run",
            "rollout_id": "$request.path.rollout_id",
            "step_id": "$response.body#/step_ids/0",
        },
        None,
    ),
    (ROLLOUT, "RolloutBundle", BUNDLE, {"key": _DETAIL_BUNDLE}, None),
    (BUNDLE, "Samples", SAMPLES, {"key": "$request.path.key"}, None),
    (
        BUNDLE,
        "Payload",
        PAYLOAD,
        {"key": "$request.path.key", "name": "$response.body#/payloads/0/name"},
        None,
    ),
)


def add_links(schema: dict[str, Any]) -> dict[str, Any]:
    """Write `LINKS` into the 200 responses of `schema` (in place; idempotent)."""
    paths = schema.get("paths", {})
    for (method, path), name, (target_method, target_path), parameters, body in LINKS:
        source = paths.get(path, {}).get(method)
        target = paths.get(target_path, {}).get(target_method)
        if source is None or target is None:  # an operation renamed: the link goes with it
            continue
        link: dict[str, Any] = {"operationId": target["operationId"]}
        if parameters:
            link["parameters"] = dict(parameters)
        if body is not None:
            link["requestBody"] = dict(body)
        source["responses"]["200"].setdefault("links", {})[name] = link
    return schema
