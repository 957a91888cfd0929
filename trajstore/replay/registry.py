"""The one registry of replay stages, read by the runner.

Each stage registers itself where it is defined (`register_stage`); the runner
asks for them by name (`get_stage`) or in chain order (`registered_stages`).
`trajstore.replay.builtin` imports every module that registers a built-in
stage, so the registry depends on no stage and no stage on another's module.

Adding a stage: name it in `trajstore.vocab.Stage` (its position there is its
place in the chain), write its run and capability functions next to the code
they check, and register a `StageDef` there; list that module in
`trajstore.replay.builtin`.

Other math for an existing link of the chain (the loss family of
`trajstore.replay.losses`) is a `StageVariant`: registered with
`register_variant`, chosen per bundle by `resolve_stage` (the runner calls it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from trajstore.errors import UsageError
from trajstore.replay.context import ReplayContext, StageOutcome
from trajstore.replay.source import BundleSource
from trajstore.vocab import STAGE_ORDER, Capability, Stage

#: what a stage's capability check returns: whether it runs here, and why not
CapabilityCheck = Callable[[BundleSource], tuple[Capability, str]]


@dataclass(frozen=True)
class StageDef:
    """One replay stage: what it reads, what it recomputes, what that is compared with.

    ``capability`` says, per bundle, whether this engine recomputes the stage
    (and why not). ``run`` is None for a stage that is never recomputed.
    ``version`` changes whenever the stage's math or comparison changes, so a
    recorded result says which implementation produced it.
    """

    name: Stage
    run: Callable[[ReplayContext], StageOutcome] | None
    capability: CapabilityCheck
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    compared_with: tuple[str, ...] = ()
    cohort_level: bool = False
    version: str = "v1"


@dataclass(frozen=True)
class StageVariant:
    """Other math for a registered stage, chosen per bundle by its config.

    Why: the loss family (TRL's loss types, GSPO, DAPO, ...) recomputes the same
    stages of the chain with other formulas; the chain and its names stay one.
    ``applies`` says whether a bundle selects this variant; the first registered
    variant that applies replaces the stage's run, capability and version.
    """

    stage: Stage
    name: str
    applies: Callable[[BundleSource], bool]
    run: Callable[[ReplayContext], StageOutcome]
    capability: CapabilityCheck
    version: str
    inputs: tuple[str, ...] = ()
    compared_with: tuple[str, ...] = ()


_STAGES: dict[Stage, StageDef] = {}
_VARIANTS: dict[Stage, list[StageVariant]] = {}


def register_stage(stage: StageDef) -> StageDef:
    """Add ``stage`` to the registry; its name must be a `Stage` not yet registered."""
    name = Stage(stage.name)
    if name in _STAGES and _STAGES[name] is not stage:
        raise ValueError(f"replay stage {name} is registered twice")
    _STAGES[name] = stage
    return stage


def register_variant(variant: StageVariant) -> StageVariant:
    """Add a config-selected variant of a stage; one name per stage once."""
    name = Stage(variant.stage)
    known = _VARIANTS.setdefault(name, [])
    if any(other.name == variant.name and other is not variant for other in known):
        raise ValueError(f"variant {variant.name} of replay stage {name} is registered twice")
    if variant not in known:
        known.append(variant)
    return variant


def resolve_stage(stage: StageDef, source: BundleSource) -> StageDef:
    """``stage`` as this bundle replays it: its first applicable variant, else itself."""
    for variant in _VARIANTS.get(Stage(stage.name), ()):
        if variant.applies(source):
            return replace(
                stage,
                run=variant.run,
                capability=variant.capability,
                version=variant.version,
                inputs=variant.inputs or stage.inputs,
                compared_with=variant.compared_with or stage.compared_with,
            )
    return stage


def get_stage(name: str) -> StageDef:
    """The registered stage called ``name``; UsageError (exit 2) for an unknown one."""
    try:
        return _STAGES[Stage(name)]
    except (ValueError, KeyError):
        raise UsageError(f"unknown stage {name}; stages: {', '.join(stage_names())}") from None


def registered_stages() -> list[StageDef]:
    """Every registered stage, upstream first (the order of `trajstore.vocab.Stage`)."""
    return [_STAGES[name] for name in STAGE_ORDER if name in _STAGES]


def stage_names() -> tuple[Stage, ...]:
    """Names of the registered stages, upstream first."""
    return tuple(stage.name for stage in registered_stages())


def capability(source: BundleSource, stage: str) -> tuple[Capability, str]:
    """(recompute | skipped | unsupported, reason) of ``stage`` on this bundle."""
    return resolve_stage(get_stage(stage), source).capability(source)
