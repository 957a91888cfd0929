"""Redaction of captured sample records, identifiers and recompute config.

Why: a bundle leaves the training cluster (laptops, object storage, REST), so
it must carry what replay needs and nothing that identifies people, data
sources or infrastructure. Everything a caller hands to capture goes through
a whitelist here; what is not whitelisted is never written. The policy that
was applied is recorded in the manifest's ``redaction`` so a reader knows
what a ``*_hash`` field is and what was truncated or dropped.

Rules:

- text fields (``prompt``, ``response``, ``label``, ``tool_output``):
  ``hash`` (``<field>_hash: "sha256:<hex>"``), ``truncate:N`` (the first N
  characters under ``<field>``) or ``drop``;
- locators (``source`` file paths, ``endpoint`` URLs) are always hashed, and
  so is any identifier (weight lineage, router engine names) that looks like
  a path or URL;
- config: only the recompute keys of replay-math.md; never environment
  variables, the argument namespace, credentials or checkpoints.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from trajstore.errors import UsageError
from trajstore.schema import Config

TEXT_FIELDS: tuple[str, ...] = ("prompt", "response", "label", "tool_output")
LOCATOR_FIELDS: tuple[str, ...] = ("source", "endpoint")
#: config keys replay understands (replay-math.md); everything else is dropped
RECOMPUTE_KEYS: frozenset[str] = frozenset(Config.FIELDS)
ROUTER_KEYS: frozenset[str] = frozenset(
    {
        "num_experts",
        "num_layers",
        "top_k",
        "mode",
        "rollout_engine",
        "train_engine",
        "rollout_weight",
        "train_weight",
    }
)
_RULE = re.compile(r"^(hash|drop|truncate:(\d+))\Z")  # \Z: "$" passes "drop\n"
_PATHLIKE = re.compile(r"[/\\]|://|^~|^[A-Za-z]:")


def digest(text: str) -> str:
    """Stable digest of a text value (same text -> same digest across runs)."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_rule(field: str, rule: str) -> str:
    if not isinstance(rule, str) or not _RULE.match(rule):
        raise UsageError(
            f"redaction rule for {field!r} is {rule!r}; expected hash, drop or truncate:N"
        )
    return rule


@dataclass(frozen=True)
class RedactionPolicy:
    """Per-field rule for the text fields; locators are always hashed."""

    prompt: str = "hash"
    response: str = "hash"
    label: str = "hash"
    tool_output: str = "drop"

    def __post_init__(self) -> None:
        for f in fields(self):
            check_rule(f.name, getattr(self, f.name))

    @classmethod
    def parse(cls, spec: str | Mapping[str, str] | RedactionPolicy | None) -> RedactionPolicy:
        """From ``"prompt=hash,response=truncate:64"`` or a mapping; unknown fields refused."""
        if spec is None:
            return cls()
        if isinstance(spec, RedactionPolicy):
            return spec
        if isinstance(spec, str):
            items: dict[str, str] = {}
            for part in (p.strip() for p in spec.split(",")):
                if not part:
                    continue
                key, sep, rule = part.partition("=")
                if not sep:
                    raise UsageError(f"redaction item {part!r} is not FIELD=RULE")
                items[key.strip()] = rule.strip()
            spec = items
        unknown = sorted(set(spec) - set(TEXT_FIELDS))
        if unknown:
            raise UsageError(
                f"redaction: unknown field(s) {', '.join(unknown)}; fields: "
                f"{', '.join(TEXT_FIELDS)}"
            )
        return cls(**dict(spec))

    def to_manifest(self) -> dict[str, str]:
        """What the manifest's ``redaction`` records."""
        out = {f: getattr(self, f) for f in TEXT_FIELDS}
        out.update({f: "hash" for f in LOCATOR_FIELDS})
        out.update({"config": "recompute-keys-only", "environment": "drop"})
        return out

    def apply(self, field: str, value: Any) -> dict[str, Any]:
        """The sample-record keys that stand for ``value`` (possibly none)."""
        if value is None:
            return {}
        text = value if isinstance(value, str) else str(value)
        if field in LOCATOR_FIELDS:
            return {f"{field}_hash": digest(text)}
        rule = getattr(self, field)
        if rule == "drop":
            return {}
        if rule == "hash":
            return {f"{field}_hash": digest(text)}
        return {field: text[: int(rule.split(":", 1)[1])]}

    def redact_sample(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """The record keys that stand for a sample's text fields and locators, in order."""
        out: dict[str, Any] = {}
        for name in (*TEXT_FIELDS, *LOCATOR_FIELDS):
            out.update(self.apply(name, sample.get(name)))
        return out

    def identifier(self, value: Any) -> str | None:
        """`redact_identifier` (the same rule for every policy)."""
        return redact_identifier(value)


def redact_identifier(value: Any) -> str | None:
    """A short identifier kept as is; a path or URL (e.g. a checkpoint) hashed."""
    if value is None:
        return None
    text = str(value)
    if _PATHLIKE.search(text) or len(text) > 128:
        return digest(text)
    return text


def _as_mapping(obj: Any) -> Mapping[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return obj
    if hasattr(obj, "__dict__"):  # argparse.Namespace and friends
        return vars(obj)
    raise UsageError(f"recompute config must be a mapping or a namespace, got {type(obj).__name__}")


def filter_config(obj: Any) -> tuple[dict[str, Any], list[str]]:
    """Keep only the recompute keys of a config (a dict or ``argparse.Namespace``).

    Returns (config, names of the dropped keys). Values of kept keys are
    type-checked by the same model the reader uses, so a malformed value is
    an error here, not an unreadable bundle later.
    """
    src = _as_mapping(obj)
    out: dict[str, Any] = {}
    for key in sorted(RECOMPUTE_KEYS & set(src)):
        value = src[key]
        if key == "router":
            if value is None:
                continue
            router = _as_mapping(value)
            value = {
                k: (redact_identifier(v) if isinstance(v, str) else v)
                for k, v in sorted(router.items())
                if k in ROUTER_KEYS
            }
        out[key] = value
    Config.from_dict(out, "capture recompute config")
    dropped = sorted(k for k in src if k not in RECOMPUTE_KEYS)
    return out, dropped
