"""Coverage-guided fuzzing of what replay reads from expected.json, through the real readers.

The first input byte picks a template bundle: a GRPO loss-family bundle
(`reward_weights`, group scaling, DAPO, the loss-side KL: `replay/losses.py`
reads `reward.raw.rewards_per_func` and `loss.policy.micro_batches` with their
`token_normalizer` and `aux_loss`) or a v1 bundle with routes (`router/stage.py`
reads `router.consistency`). The rest of the input is the template's
expected.json: written into the bundle, re-signed in COMPLETE and COMPLETE.<r>,
opened by the bundle reader (`parse_expected`) and replayed through every stage
(`replay_sources`, as `trajstore replay DIR` does), so every reader of
expected.json sees it: the per-sample lists (`ReplayContext.expected_per_sample`),
the loss family's records, the v1 stages' and router.consistency's.

Mutations: half of them libFuzzer's byte mutations, half a structural one
(`custom_mutator`): one value anywhere in the document replaced by a value of
another kind (a string, null, a bool, a list, an object, 0, -1, an integer past
float64, ...) or a key dropped. Byte mutations almost never turn a number into a
string and keep the JSON valid; a bug planted in `expected_per_sample` (its
number check dropped) went unfound in 16,434 inputs without it.

Property: a report (any verdict), or a TrajstoreError with a one-line message;
nothing else. The templates' numbers need not agree with their payloads: a
divergence is a verdict, not a finding.
"""

from __future__ import annotations

import atexit
import copy
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import atheris
import numpy as np

with atheris.instrument_imports(include=["trajstore"]):
    from trajstore.examples.replay_builders import consistent_contents

    from trajstore.bundle.reader import open_target
    from trajstore.bundle.writer import BundleContents, write_bundle
    from trajstore.errors import TrajstoreError
    from trajstore.jsonio import sha256_bytes
    from trajstore.replay.runner import ReplayReport, replay_sources

_ROOT = Path(tempfile.mkdtemp(prefix="fuzz-expected-"))
atexit.register(shutil.rmtree, _ROOT, True)

#: a loss-family config under which every family stage replays (capability recompute)
FAMILY_CONFIG = {
    "advantage_estimator": "grpo",
    "n_samples_per_prompt": 4,
    "use_kl_loss": True,
    "kl_loss_coef": 0.04,
    "eps_clip": 0.2,
    "policy_loss": "dapo",
    "reward_weights": [1.0, 0.5],
    "reward_scale": "group",
    "aux_loss_coef": 0.01,
}
_TEMPLATES: list[Path] = []


def routed_contents() -> BundleContents:
    """A v1 bundle with routes (2 samples of 3 + 3 tokens, 2 layers, top-2 of 8 experts)."""
    rng = np.random.default_rng(0)
    routes = np.stack([rng.permutation(8)[:2] for _ in range(24)]).reshape(12, 2, 2)
    log_probs = rng.normal(-1.0, 0.3, 6).astype(np.float32)
    samples = [
        {
            "sample_id": f"s-{i}",
            "group_index": 0,
            "response_length": 3,
            "total_length": 6,
            "loss_mask": [1, 1, 1],
            "reward": 0.0,
        }
        for i in range(2)
    ]
    return BundleContents(
        bundle_id="routed",
        identity={"actor_step_id": {"rollout_id": 1, "step_id": 0}, "rollout_id": None},
        samples=samples,
        config={
            "advantage_estimator": "grpo",
            "router": {"num_experts": 8, "num_layers": 2, "top_k": 2, "mode": "baseline"},
        },
        payloads={
            "rollout_routed_experts": routes.astype(np.uint8),
            "train_routed_experts": routes.astype(np.uint8),
            "rollout_log_probs": log_probs,
            "train_log_probs": log_probs,
        },
        expected={"router.consistency": {"route_mismatch_rate": 0.0, "hang_count": 0}},
        producer={"commit": "fuzz", "dirty_patch_digest": "", "torch_version": "2"},
    )


def templates() -> list[Path]:
    """The template bundles (loss family, routed), written once per process."""
    if not _TEMPLATES:
        family = consistent_contents(groups=2, n=4, lengths=3, config=FAMILY_CONFIG).contents
        _TEMPLATES.append(write_bundle(_ROOT / "family", family))
        _TEMPLATES.append(write_bundle(_ROOT / "routed", routed_contents()))
    return _TEMPLATES


def replay_with_expected(template: int, raw: bytes) -> ReplayReport:
    """Template `template` (modulo their number) with `raw` as its expected.json,
    re-signed, opened by the bundle reader and replayed through every stage."""
    bundle = templates()[template % len(templates())]
    (bundle / "expected.json").write_bytes(raw)
    for name in ("COMPLETE", *(p.name for p in bundle.glob("COMPLETE.*"))):
        doc = json.loads((bundle / name).read_bytes())
        doc["metadata"]["expected.json"] = sha256_bytes(raw)
        (bundle / name).write_text(json.dumps(doc))
    return replay_sources(open_target(bundle).bundles, label="fuzz")


#: what a structural mutation puts in place of a value: each kind a reader may not expect
SUBSTITUTES: tuple = ("x", "", None, True, False, [], {}, 0, -1, 0.5, 10**400, [1.5], {"a": 1})


def _slots(doc: object) -> list[tuple[dict | list, object]]:
    """(container, key or index) of every value inside `doc`."""
    out: list[tuple[dict | list, object]] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            out.append((node, key))
            if isinstance(value, (dict, list)):
                stack.append(value)
    return out


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    """Half the time one value of the JSON document replaced by another kind of value (or a
    key dropped), keeping the template byte; otherwise libFuzzer's own byte mutation."""
    rng = random.Random(seed)
    if len(data) > 1 and rng.random() < 0.5:
        try:
            doc = json.loads(data[1:])
        except (ValueError, RecursionError):
            doc = None
        slots = _slots(doc) if isinstance(doc, (dict, list)) else []
        if slots:
            container, key = rng.choice(slots)
            if isinstance(container, dict) and rng.random() < 0.2:
                del container[key]
            else:
                container[key] = copy.deepcopy(rng.choice(SUBSTITUTES))
            out = data[:1] + json.dumps(doc).encode()
            if len(out) <= max_size:
                return out
    return atheris.Mutate(data, max_size)


def one_input(data: bytes) -> None:
    """Only a one-line TrajstoreError may escape; any other exception is a finding."""
    if not data:
        return
    try:
        replay_with_expected(data[0], data[1:])
    except TrajstoreError as exc:
        if "\n" in str(exc):
            raise AssertionError(f"multi-line error message: {exc!r:.200}") from None


def main() -> None:
    atheris.Setup(sys.argv, one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
