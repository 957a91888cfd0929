"""Typed models of a replay bundle's JSON documents (both format majors).

Every model keeps the exact set of keys it was read from, including keys it
does not know, so ``Model.from_dict(d).to_dict() == d`` for documents of
format major 1 and 2 alike. Unknown top-level keys of manifest.json and
index.json are reported as warnings (``unknown_keys``); an unknown major
format is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trajstore.errors import BundleError
from trajstore.jsonio import is_binary_int_list
from trajstore.vocab import REWARD_STAGES, DeclaredCapability

SUPPORTED_MAJORS = (1, 2)
WRITE_FORMAT_VERSION = "1.0.0"
#: the capabilities a stage contract may declare (plain strings, as the manifest spells them)
CAPABILITIES: tuple[str, ...] = tuple(capability.value for capability in DeclaredCapability)
DEFAULT_ATOL = 1e-6
DEFAULT_RTOL = 1e-5


_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:[-+.][0-9A-Za-z.+-]*)?$")


def format_major(version: Any) -> int:
    """Major of a ``format_version`` string; refuses anything but 1.x.y / 2.x.y."""
    m = _VERSION.match(version) if isinstance(version, str) else None
    if m is None:
        raise BundleError(f"format_version {version!r} is not a 'MAJOR.MINOR.PATCH' string")
    major = int(m.group(1))
    if major not in SUPPORTED_MAJORS:
        raise BundleError(
            f"unsupported format major {major} (format_version {version!r}); "
            f"this trajstore reads majors {', '.join(map(str, SUPPORTED_MAJORS))}"
        )
    return major


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check(where: str, key: str, value: Any, types: tuple[type, ...], nullable: bool) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) and bool not in types and int in types:
        raise BundleError(f"{where}: '{key}' must be {'/'.join(map(_type_name, types))}, got bool")
    if not isinstance(value, types):
        want = "/".join(map(_type_name, types)) + (" or null" if nullable else "")
        raise BundleError(f"{where}: '{key}' must be {want}, got {type(value).__name__}")


@dataclass
class Doc:
    """Base: a JSON object with declared keys and verbatim unknown keys.

    Subclasses declare ``FIELDS = {key: (types, nullable, required)}``; nested
    models are converted by ``_nested`` hooks.
    """

    FIELDS: ClassVar[dict[str, tuple[tuple[type, ...], bool, bool]]] = {}
    WHERE: ClassVar[str] = "document"

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: Any, where: str | None = None):  # noqa: ANN206
        where = where or cls.WHERE
        if not isinstance(d, dict):
            raise BundleError(f"{where}: expected a JSON object, got {type(d).__name__}")
        for key, (types, nullable, required) in cls.FIELDS.items():
            if key not in d:
                if required:
                    raise BundleError(f"{where}: missing required key '{key}'")
                continue
            value = d[key]
            if type(value) not in types:  # exact types pass at once (a bool is exact only as bool)
                _check(where, key, value, types, nullable)
        obj = cls(raw=dict(d))
        obj._validate(where)
        return obj

    def _validate(self, where: str) -> None:
        """Hook for cross-field checks."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    @property
    def unknown_keys(self) -> list[str]:
        return sorted(k for k in self.raw if k not in self.FIELDS)


_STR = (str,)
_INT = (int,)
_NUM = (int, float)
_LIST = (list,)
_DICT = (dict,)


@dataclass
class PayloadSpec(Doc):
    FIELDS: ClassVar = {
        "name": (_STR, False, True),
        "dtype": (_STR, False, True),
        "shape": (_LIST, False, True),
        "bytes": (_INT, False, True),
        "sha256": (_STR, False, True),
    }
    WHERE: ClassVar[str] = "manifest.json payload"

    def _validate(self, where: str) -> None:
        shape = self.raw["shape"]
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise BundleError(f"{where} '{self.name}': shape must be a list of non-negative ints")
        if self.raw["bytes"] < 0:
            raise BundleError(f"{where} '{self.name}': bytes must be >= 0")

    name = property(lambda self: self.raw["name"])
    dtype = property(lambda self: self.raw["dtype"])
    shape = property(lambda self: tuple(self.raw["shape"]))
    bytes = property(lambda self: self.raw["bytes"])
    sha256 = property(lambda self: self.raw["sha256"])


@dataclass
class StageContract(Doc):
    FIELDS: ClassVar = {
        "stage": (_STR, False, True),
        "version": (_STR, False, False),
        "capability": (_STR, False, True),
        "implementation": (_STR, False, False),
        "inputs": (_LIST, False, False),
        "expected_outputs": (_LIST, False, False),
    }
    WHERE: ClassVar[str] = "manifest.json stage contract"

    def _validate(self, where: str) -> None:
        if self.raw["capability"] not in CAPABILITIES:
            raise BundleError(
                f"{where} '{self.raw['stage']}': unknown capability {self.raw['capability']!r}"
            )

    stage = property(lambda self: self.raw["stage"])
    capability = property(lambda self: self.raw["capability"])


@dataclass
class Manifest(Doc):
    FIELDS: ClassVar = {
        "format_version": (_STR, False, True),
        "bundle_id": (_STR, False, True),
        "producer": (_DICT, False, True),
        "stage_contracts": (_DICT, False, True),
        "payloads": (_DICT, False, True),
        "comparison_policy": (_DICT, False, False),
        "redaction": (_DICT, False, False),
    }
    WHERE: ClassVar[str] = "manifest.json"
    payloads: dict[str, PayloadSpec] = field(default_factory=dict)
    stage_contracts: dict[str, StageContract] = field(default_factory=dict)

    def _validate(self, where: str) -> None:
        self.major = format_major(self.raw["format_version"])
        for key, spec in self.raw["payloads"].items():
            ps = PayloadSpec.from_dict(spec, f"{where} payload '{key}'")
            if ps.name != key:
                raise BundleError(f"{where}: payload key '{key}' names '{ps.name}'")
            self.payloads[key] = ps
        for key, spec in self.raw["stage_contracts"].items():
            self.stage_contracts[key] = StageContract.from_dict(spec, f"{where} stage '{key}'")
        for k in ("commit", "dirty_patch_digest", "torch_version"):
            v = self.raw["producer"].get(k)
            if v is not None and not isinstance(v, str):
                raise BundleError(f"{where}: producer.{k} must be a string")
        policy = self.raw.get("comparison_policy", {})
        if not isinstance(policy.get("tolerances", {}), dict):
            raise BundleError(
                f"{where}: comparison_policy.tolerances must be an object keyed by stage"
            )
        if not isinstance(policy.get("exact_fields", []), list):
            raise BundleError(f"{where}: comparison_policy.exact_fields must be a list")
        for stage, tol in policy.get("tolerances", {}).items():
            if not isinstance(tol, dict) or not all(
                isinstance(tol.get(k, 0.0), (int, float)) for k in ("atol", "rtol")
            ):
                raise BundleError(
                    f"{where}: tolerances of '{stage}' must be {{atol, rtol}} numbers"
                )

    format_version = property(lambda self: self.raw["format_version"])
    bundle_id = property(lambda self: self.raw["bundle_id"])
    producer = property(lambda self: self.raw["producer"])

    def tolerance(self, stage: str) -> tuple[float, float]:
        tol = self.raw.get("comparison_policy", {}).get("tolerances", {}).get(stage, {})
        return float(tol.get("atol", DEFAULT_ATOL)), float(tol.get("rtol", DEFAULT_RTOL))

    @property
    def exact_fields(self) -> list[str]:
        return list(self.raw.get("comparison_policy", {}).get("exact_fields", []))

    def warnings(self) -> list[str]:
        out = [f"manifest.json: unknown top-level key '{k}' (ignored)" for k in self.unknown_keys]
        if not self.producer.get("commit"):
            out.append("manifest.json: producer.commit is empty")
        return out


@dataclass
class Sample(Doc):
    FIELDS: ClassVar = {
        "sample_id": (_STR, False, True),
        "group_index": (_INT, True, False),
        "response_length": (_INT, False, True),
        "total_length": (_INT, False, True),
        "loss_mask": (_LIST, False, True),
        "reward": ((int, float, list), True, False),
        "raw_reward": (_NUM, True, False),
        "label_hash": (_STR, True, False),
        "micro_batch_id": (_STR, True, False),
    }
    WHERE: ClassVar[str] = "index.json sample"

    def _validate(self, where: str) -> None:
        mask = self.raw["loss_mask"]
        # C-speed (masks are long): a mask of plain 0/1 ints passes without a type scan
        if not is_binary_int_list(mask) and not set(map(type, mask)) <= {int, bool}:
            raise BundleError(
                f"{where} '{self.raw['sample_id']}': loss_mask entries must be integers"
            )

    sample_id = property(lambda self: self.raw["sample_id"])
    group_index = property(lambda self: self.raw.get("group_index"))
    response_length = property(lambda self: self.raw["response_length"])
    total_length = property(lambda self: self.raw["total_length"])
    loss_mask = property(lambda self: self.raw["loss_mask"])
    reward = property(lambda self: self.raw.get("reward"))
    raw_reward = property(lambda self: self.raw.get("raw_reward"))
    micro_batch_id = property(lambda self: self.raw.get("micro_batch_id"))

    @property
    def semantic_group(self) -> str | None:
        g = self.group_index
        return None if g is None else f"g-{g}"


@dataclass
class Identity(Doc):
    FIELDS: ClassVar = {
        "actor_step_id": (_DICT, True, True),
        "rollout_id": (_INT, True, True),
        "rollout_partition_ids": (_LIST, False, False),
        "consumer_batch_ids": (_LIST, False, False),
        "micro_batch_ids": (_LIST, False, False),
        "semantic_group_ids": (_LIST, False, False),
        "normalization_cohort_ids": (_LIST, False, False),
        "weight_lineage": (_DICT, True, False),
        "rank": (_DICT, False, False),
    }
    WHERE: ClassVar[str] = "index.json identity"

    def _validate(self, where: str) -> None:
        step = self.raw.get("actor_step_id")
        rollout = self.raw.get("rollout_id")
        if (step is None) == (rollout is None):
            raise BundleError(
                f"{where}: exactly one of actor_step_id and rollout_id must be set "
                f"(got actor_step_id={step!r}, rollout_id={rollout!r})"
            )
        if step is not None:
            for k in ("rollout_id", "step_id"):
                v = step.get(k)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise BundleError(f"{where}: actor_step_id.{k} must be a non-negative int")
        elif rollout < 0:
            raise BundleError(f"{where}: rollout_id must be a non-negative int")
        for k, v in self.raw.get("rank", {}).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BundleError(f"{where}: rank.{k} must be a positive int (world size)")

    @property
    def kind(self) -> str:
        return "step" if self.raw.get("actor_step_id") is not None else "rollout"

    @property
    def rollout_id(self) -> int:
        step = self.raw.get("actor_step_id")
        return step["rollout_id"] if step is not None else self.raw["rollout_id"]

    @property
    def step_id(self) -> int | None:
        step = self.raw.get("actor_step_id")
        return None if step is None else step["step_id"]

    @property
    def anchor(self) -> str:
        """Display form: ``120:0`` for a step, ``rollout 120`` for a rollout."""
        if self.kind == "step":
            return f"{self.rollout_id}:{self.step_id}"
        return f"rollout {self.rollout_id}"

    @property
    def cp(self) -> int:
        return int(self.raw.get("rank", {}).get("cp", 1))


@dataclass
class Index(Doc):
    FIELDS: ClassVar = {
        "bundle_id": (_STR, False, True),
        "identity": (_DICT, False, True),
        "samples": (_LIST, False, True),
        "config": (_DICT, False, True),
        "extensions": (_DICT, False, False),
    }
    WHERE: ClassVar[str] = "index.json"
    identity: Identity | None = None
    samples: list[Sample] = field(default_factory=list)

    config_model: Config | None = None

    def _validate(self, where: str) -> None:
        self.identity = Identity.from_dict(self.raw["identity"], f"{where} identity")
        self.config_model = Config.from_dict(self.raw["config"], f"{where} config")
        self.samples = [
            Sample.from_dict(s, f"{where} samples[{i}]") for i, s in enumerate(self.raw["samples"])
        ]

    bundle_id = property(lambda self: self.raw["bundle_id"])
    config = property(lambda self: self.raw["config"])

    def warnings(self) -> list[str]:
        return [f"index.json: unknown top-level key '{k}' (ignored)" for k in self.unknown_keys]


#: config keys of the GRPO loss family (replay-math.md "Loss family"): understood only by the
#: family variants of the stages (trajstore/replay/losses.py); the v1 stages refuse them
LOSS_FAMILY_FIELDS: dict[str, tuple[tuple[type, ...], bool, bool]] = {
    "policy_loss": (_STR, True, False),
    "importance_sampling_level": (_STR, True, False),
    "delta": (_NUM, True, False),
    "top_entropy_quantile": (_NUM, True, False),
    "mask_truncated_completions": ((bool,), True, False),
    "max_response_length": (_INT, True, False),
    "gradient_accumulation_steps": (_INT, True, False),
    "steps_per_generation": (_INT, True, False),
    "loss_token_normalizer": (_NUM, True, False),
    "sapo_temperature_pos": (_NUM, True, False),
    "sapo_temperature_neg": (_NUM, True, False),
    "off_policy_mask_threshold": (_NUM, True, False),
    "is_correction": (_STR, True, False),
    "is_clip_min": (_NUM, True, False),
    "is_clip_max": (_NUM, True, False),
    "aux_loss_coef": (_NUM, True, False),
    "reward_scale": (_STR, True, False),
    "reward_std_eps": (_NUM, True, False),
    "reward_sum_order": (_STR, True, False),
    "reward_aggregation": (_STR, True, False),
    "reward_weights": (_LIST, True, False),
}


@dataclass
class Config(Doc):
    """index.json ``config``: the recompute configuration (replay-math.md).

    Keys outside ``FIELDS`` are kept; the replay engine marks the stages they
    could affect ``unsupported`` instead of guessing what they mean.
    """

    FIELDS: ClassVar = {
        "advantage_estimator": (_STR, False, False),
        "n_samples_per_prompt": (_INT, True, False),
        "rewards_normalization": ((bool,), False, False),
        "grpo_std_normalization": ((bool,), False, False),
        "kl_coef": (_NUM, False, False),
        "kl_loss_type": (_STR, False, False),
        "use_kl_loss": ((bool,), False, False),
        "kl_loss_coef": (_NUM, False, False),
        "eps_clip": (_NUM, False, False),
        "eps_clip_high": (_NUM, True, False),
        "eps_clip_c": (_NUM, True, False),
        "entropy_coef": (_NUM, False, False),
        "use_unbiased_kl": ((bool,), False, False),
        "router": (_DICT, True, False),
        #: slime's arguments, for bundles made from its dumps (trajstore/replay/slime_math.py)
        "slime": (_DICT, True, False),
        #: verl's settings, for bundles its capture writes (trajstore/integrations/verl/records.py
        #: `algorithm_config`; replayed by trajstore/replay/verl_math.py)
        "verl": (_DICT, True, False),
        **LOSS_FAMILY_FIELDS,
    }
    WHERE: ClassVar[str] = "index.json config"


@dataclass
class RankShard(Doc):
    """``COMPLETE.<rank>``: one rank's claim on payloads and metadata."""

    FIELDS: ClassVar = {
        "actor_step_id": (_DICT, True, True),
        "rollout_id": (_INT, True, True),
        "payloads": (_DICT, False, True),
        "metadata": (_DICT, False, True),
        "expected_ranks": (_LIST, False, True),
        "relpath": (_STR, False, False),
    }
    WHERE: ClassVar[str] = "COMPLETE.<rank>"

    payloads = property(lambda self: self.raw["payloads"])
    metadata = property(lambda self: self.raw["metadata"])
    expected_ranks = property(lambda self: list(self.raw["expected_ranks"]))

    def anchor(self) -> tuple[Any, Any]:
        return (self.raw.get("actor_step_id"), self.raw.get("rollout_id"))


@dataclass
class Complete(Doc):
    """A bundle's ``COMPLETE``: ``{ranks, metadata, expected_ranks}``."""

    FIELDS: ClassVar = {
        "ranks": (_LIST, False, True),
        "metadata": (_DICT, False, True),
        "expected_ranks": (_LIST, False, True),
    }
    WHERE: ClassVar[str] = "COMPLETE"

    def _validate(self, where: str) -> None:
        for key in ("ranks", "expected_ranks"):
            if not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.raw[key]
            ):
                raise BundleError(f"{where}: '{key}' must be a list of non-negative ints")
        for name in ("manifest.json", "index.json", "expected.json"):
            if not isinstance(self.raw["metadata"].get(name), str):
                raise BundleError(f"{where}: metadata has no sha256 for {name}")

    ranks = property(lambda self: list(self.raw["ranks"]))
    metadata = property(lambda self: self.raw["metadata"])
    expected_ranks = property(lambda self: list(self.raw["expected_ranks"]))


@dataclass
class CohortComplete(Doc):
    """A multi-rank cohort's ``COMPLETE``: ``{ranks, shards}``."""

    FIELDS: ClassVar = {"ranks": (_LIST, False, True), "shards": (_DICT, False, True)}
    WHERE: ClassVar[str] = "cohort COMPLETE"

    def _validate(self, where: str) -> None:
        bad = [k for k in self.raw["shards"] if not re.fullmatch(r"[0-9]{1,9}", k)]
        if bad:
            raise BundleError(f"{where}: shard key {bad[0][:40]!r} is not a rank number")
        self.shards = {
            int(k): RankShard.from_dict(v, f"{where} shard {k}")
            for k, v in self.raw["shards"].items()
        }

    ranks = property(lambda self: list(self.raw["ranks"]))


__all__ = [
    "CAPABILITIES",
    "REWARD_STAGES",
    "Complete",
    "CohortComplete",
    "Identity",
    "Index",
    "Manifest",
    "PayloadSpec",
    "RankShard",
    "Sample",
    "StageContract",
    "Config",
    "format_major",
]
