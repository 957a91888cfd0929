"""Convert a bundle's documents between format majors 1 and 2.

Major 2 (the public producer) has no reward stages: its rewards arrive
post-processed. Going 1 -> 2 drops what major 2 does not carry (raw rewards,
the reward stages and their expectations, the normalization keys); going
2 -> 1 relabels the contracts and drops `loss.value`. Payload files are
reused byte for byte either way. What cannot be expressed is refused.
"""

from __future__ import annotations

import copy
from typing import Any

from trajstore.bundle.writer import BundleContents
from trajstore.errors import UsageError
from trajstore.vocab import REWARD_STAGES, Stage

MAJOR1_CONFIG_KEYS = ("n_samples_per_prompt", "grpo_std_normalization")
FORMAT_VERSIONS = {1: "1.0.0", 2: "2.0.0"}
LOSS_VALUE_CONTRACT = {
    "capability": "unsupported",
    "expected_outputs": [],
    "implementation": "reuse",
    "inputs": [],
    "stage": Stage.LOSS_VALUE,
    "version": "v2",
}


def convert_contents(
    manifest: dict[str, Any],
    index: dict[str, Any],
    expected: dict[str, Any],
    payload_files: dict[str, bytes],
    target_major: int,
) -> BundleContents:
    """BundleContents of the same bundle in ``target_major`` (1 or 2)."""
    if target_major not in FORMAT_VERSIONS:
        raise UsageError(f"--format must be 1 or 2, not {target_major}")
    m, ix, ex = copy.deepcopy(manifest), copy.deepcopy(index), copy.deepcopy(expected)
    contracts = m["stage_contracts"]
    samples, config, identity = ix["samples"], ix["config"], ix["identity"]
    version = f"v{target_major}"
    if target_major == 2:
        for stage in REWARD_STAGES:
            contracts.pop(stage, None)
            ex.pop(stage, None)
        for s in samples:
            s.pop("raw_reward", None)
        for k in MAJOR1_CONFIG_KEYS:
            config.pop(k, None)
        identity.pop("normalization_cohort_ids", None)
        contracts[Stage.LOSS_VALUE] = dict(LOSS_VALUE_CONTRACT)
    else:
        per_token = [s["sample_id"] for s in samples if isinstance(s.get("reward"), list)]
        if per_token:
            raise UsageError(
                f"sample(s) {', '.join(per_token[:5])} carry per-token rewards, "
                "which major 1 cannot express"
            )
        contracts.pop(Stage.LOSS_VALUE, None)
    for c in contracts.values():
        c["version"] = version
    known = {
        "bundle_id",
        "comparison_policy",
        "format_version",
        "payloads",
        "producer",
        "redaction",
        "stage_contracts",
    }
    return BundleContents(
        bundle_id=m["bundle_id"],
        identity=identity,
        samples=samples,
        config=config,
        payloads=dict(payload_files),
        expected=ex,
        stage_contracts=contracts,
        producer=m["producer"],
        comparison_policy=m.get("comparison_policy"),
        redaction=m.get("redaction"),
        format_version=FORMAT_VERSIONS[target_major],
        extra_manifest={k: v for k, v in m.items() if k not in known},
    )
