"""slime's training arguments, as far as the replay of its dumps needs them.

slime saves no arguments beside its dumps (``--dump-details`` writes the two dumps and the
tokenizer), so the user passes them at ingest: ``--config FILE``, either a JSON object of
slime's argument names (``{"advantage_estimator": "gspo", ...}``, dashes or underscores,
e.g. ``vars(args)`` or the run's wandb config values) or the command-line flags the run
was launched with (``--advantage-estimator gspo --n-samples-per-prompt 8 ...``; comments
and line breaks allowed; flags replay does not read are skipped). What replay reads is
written into each bundle's ``config.slime`` (docs/integrations.md); without ``--config``
it records ``args_given: false`` and the math stages say so.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from trajstore.errors import UsageError


def _typed_args(kind: type, **defaults: Any) -> dict[str, tuple[type, Any]]:
    return {name: (kind, default) for name, default in defaults.items()}


#: slime's argument -> (type, slime's default); the flags of slime/utils/arguments.py that
#: replay reads (their order does not matter: a bundle's JSON is written with sorted keys)
ARGS: dict[str, tuple[type, Any]] = {
    **_typed_args(str, advantage_estimator="grpo", kl_loss_type="k1", reward_key=None),
    **_typed_args(str, custom_advantage_function_path=None, custom_reward_post_process_path=None),
    **_typed_args(int, n_samples_per_prompt=1, rollout_batch_size=None, num_experts=None),
    **_typed_args(int, global_batch_size=None),
    **_typed_args(float, kl_coef=0.0, gamma=1.0),
    **_typed_args(bool, rewards_normalization=True, grpo_std_normalization=True),
    **_typed_args(bool, normalize_advantages=False, use_rollout_logprobs=False, use_opd=False),
    **_typed_args(bool, compute_advantages_and_returns=True),
    **_typed_args(bool, use_routing_replay=False, use_rollout_routing_replay=False),
}
#: flags that set a boolean without a value, and the value they set
_SWITCHES: dict[str, tuple[str, bool]] = {
    "--disable-rewards-normalization": ("rewards_normalization", False),
    "--disable-grpo-std-normalization": ("grpo_std_normalization", False),
    "--disable-compute-advantages-and-returns": ("compute_advantages_and_returns", False),
    "--normalize-advantages": ("normalize_advantages", True),
    "--use-rollout-logprobs": ("use_rollout_logprobs", True),
    "--use-opd": ("use_opd", True),
    "--use-routing-replay": ("use_routing_replay", True),
    "--use-rollout-routing-replay": ("use_rollout_routing_replay", True),
}


def defaults() -> dict[str, Any]:
    return {name: default for name, (_, default) in ARGS.items()}


def _typed(name: str, value: Any, where: str) -> Any:
    kind = ARGS[name][0]
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    raise UsageError(f"{where}: {name} = {value!r} is not a {kind.__name__}")


def _from_mapping(doc: dict[str, Any], where: str) -> dict[str, Any]:
    out = defaults()
    for key, value in doc.items():
        name = str(key).lstrip("-").replace("-", "_")
        if isinstance(value, dict) and set(value) >= {"value"}:  # a wandb config entry
            value = value["value"]
        if name in ARGS:
            out[name] = _typed(name, value, where)
    return out


def _from_flags(text: str, where: str) -> dict[str, Any]:
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")  # a shell line continuation
    try:
        words = shlex.split(text, comments=True)
    except ValueError as exc:
        raise UsageError(f"{where}: cannot split into flags: {exc}") from None
    out = defaults()
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        flag, eq, inline = word.partition("=")
        if flag in _SWITCHES and not eq:
            name, value = _SWITCHES[flag]
            out[name] = value
            continue
        name = flag[2:].replace("-", "_")
        if eq:
            value = inline
        elif i < len(words) and not words[i].startswith("--"):
            value = words[i]
            i += 1
        else:
            continue
        if name in ARGS and ARGS[name][0] is not bool:
            out[name] = _typed(name, value, where)
    return out


def read_args(path: str | None) -> dict[str, Any]:
    """The arguments replay reads, from `path` (JSON object or flags), slime's defaults for
    the rest; ``args_given`` says whether a file was given at all."""
    if path is None:
        return {**defaults(), "args_given": False}
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {path}: cannot be read: {exc}") from None
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--config {path}: not valid JSON: {exc}") from None
        args = _from_mapping(doc, f"--config {path}")
    else:
        args = _from_flags(text, f"--config {path}")
    estimator = args["advantage_estimator"]
    known = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
    if estimator not in known:
        raise UsageError(
            f"--config {path}: advantage_estimator {estimator!r} is not one of slime's "
            f"({', '.join(known)})"
        )
    if args["n_samples_per_prompt"] is not None and args["n_samples_per_prompt"] < 1:
        raise UsageError(f"--config {path}: n_samples_per_prompt must be >= 1")
    return {**args, "args_given": True}
