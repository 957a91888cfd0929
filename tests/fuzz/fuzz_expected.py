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

Property: a report (any verdict), or a TrajstoreError with a one-line message;
nothing else. The templates' numbers need not agree with their payloads: a
divergence is a verdict, not a finding.
"""

from __future__ import annotations

import atexit
import json
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
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
