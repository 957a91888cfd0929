"""Capture configuration, explicit or from the environment.

Why parse eagerly: a typo in ``TRAJSTORE_CAPTURE_STEPS`` must stop the run at
start-up, not silently capture nothing for a week or fail at step 5,000. So
every recognised variable is parsed at construction (even with capture off)
and a malformed one raises `CaptureConfigError` naming the variable; so does a
``TRAJSTORE_CAPTURE*`` variable that is none of these (a misspelt name).

Variables (the public producer's ``RELAX_REPLAY_CAPTURE*`` spellings are
accepted too; both spellings set to different values is an error):

| variable | meaning |
|---|---|
| TRAJSTORE_CAPTURE / RELAX_REPLAY_CAPTURE | 1/true/yes/on switches capture on (default off) |
| TRAJSTORE_CAPTURE_DIR / RELAX_REPLAY_CAPTURE_DIR | write bundle directories here |
| TRAJSTORE_CAPTURE_STORE | write straight into this store instead |
| TRAJSTORE_CAPTURE_STEPS / RELAX_REPLAY_CAPTURE_STEPS | ``R:S,R:S`` steps (unset/empty: all) |
| TRAJSTORE_CAPTURE_ROLLOUTS / RELAX_REPLAY_CAPTURE_ROLLOUTS | ``R,R`` rollouts (unset/empty: all) |
| TRAJSTORE_RUN | run name (``[A-Za-z0-9._-]``, default ``default``) |
| TRAJSTORE_CAPTURE_QUEUE_SIZE | bounded queue length in bundles (default 64) |
| TRAJSTORE_CAPTURE_BLOCK | 1: wait for queue space instead of dropping |
| TRAJSTORE_CAPTURE_WRITER | ``process`` (default on POSIX) or ``thread``: who writes bundles |
| TRAJSTORE_CAPTURE_DURABLE | 1: fsync every bundle so it survives a power loss (default off) |
| TRAJSTORE_CAPTURE_REDACT | e.g. ``prompt=hash,response=truncate:64,tool_output=drop`` |
| TRAJSTORE_PRODUCER_COMMIT | trainer commit recorded as manifest ``producer.commit`` |
| TRAJSTORE_CAPTURE_SESSION | s3:// store: an id all ranks of one launch share (the job id) |
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trajstore.capture.redaction import RedactionPolicy
from trajstore.errors import UsageError
from trajstore.jsonio import user_path

DEFAULT_QUEUE_SIZE = 64
DEFAULT_RUN = "default"
#: where bundles are written: a thread of the training process, or a process of its own
WRITERS = ("thread", "process")
DEFAULT_WRITER = "process" if os.name == "posix" else "thread"
# fullmatch everywhere: with .match, "$" also matches before a final "\n" ("run\n" passed)
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_STEP = re.compile(r"(\d+):(\d+)")
_COMMIT = re.compile(r"[0-9A-Za-z._-]{0,64}")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})

#: setting -> accepted variable names, preferred first
ENV_VARS: dict[str, tuple[str, ...]] = {
    "enabled": ("TRAJSTORE_CAPTURE", "RELAX_REPLAY_CAPTURE"),
    "output_dir": ("TRAJSTORE_CAPTURE_DIR", "RELAX_REPLAY_CAPTURE_DIR"),
    "store_dir": ("TRAJSTORE_CAPTURE_STORE",),
    "steps": ("TRAJSTORE_CAPTURE_STEPS", "RELAX_REPLAY_CAPTURE_STEPS"),
    "rollouts": ("TRAJSTORE_CAPTURE_ROLLOUTS", "RELAX_REPLAY_CAPTURE_ROLLOUTS"),
    "run": ("TRAJSTORE_RUN",),
    "queue_size": ("TRAJSTORE_CAPTURE_QUEUE_SIZE",),
    "block": ("TRAJSTORE_CAPTURE_BLOCK",),
    "writer": ("TRAJSTORE_CAPTURE_WRITER",),
    "durable": ("TRAJSTORE_CAPTURE_DURABLE",),
    "redaction": ("TRAJSTORE_CAPTURE_REDACT",),
    "producer_commit": ("TRAJSTORE_PRODUCER_COMMIT",),
    "session": ("TRAJSTORE_CAPTURE_SESSION",),
}


class CaptureConfigError(UsageError):
    """Capture is misconfigured; raised at construction, never mid-training."""


def parse_bool(text: str, var: str) -> bool:
    v = text.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise CaptureConfigError(
        f"{var}={text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)"
    )


def parse_steps(
    text: str, var: str = "TRAJSTORE_CAPTURE_STEPS"
) -> frozenset[tuple[int, int]] | None:
    """``"120:0,120:1"`` -> {(120, 0), (120, 1)}; empty -> None (all steps)."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items:
        return None
    out = set()
    for item in items:
        m = _STEP.fullmatch(item)
        if not m or not item.isascii():
            raise CaptureConfigError(
                f"{var}: item {item!r} is not ROLLOUT_ID:STEP_ID "
                "with non-negative integers (e.g. 120:0)"
            )
        out.add((int(m.group(1)), int(m.group(2))))
    return frozenset(out)


def parse_rollouts(text: str, var: str = "TRAJSTORE_CAPTURE_ROLLOUTS") -> frozenset[int] | None:
    """``"3,7"`` -> {3, 7}; empty -> None (all rollouts)."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items:
        return None
    bad = [i for i in items if not (i.isascii() and i.isdigit())]
    if bad:
        raise CaptureConfigError(f"{var}: item {bad[0]!r} is not a non-negative integer rollout id")
    return frozenset(int(i) for i in items)


def normalize_id(value: Any, what: str = "id") -> int:
    """A trainer's rollout/step/micro-batch id as a non-negative int.

    The one place ids are normalised, so the step filter and the bundle agree: an int, a
    numpy integer, a 0-d tensor, an integral float or an ASCII decimal string ("7") is the
    int it spells. A bool, a negative or fractional number, or other text raises
    ValueError (the manager counts it; a bundle named after ``int("x")`` cannot exist).
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is a bool, not a non-negative integer")
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.isdigit()):
            raise ValueError(f"{what} {value!r} is not a non-negative integer")
        return int(text)
    try:
        out = operator.index(value)  # int, numpy integer, 0-d integer tensor
    except TypeError:
        try:
            number = float(value)  # float, numpy floating, 0-d float tensor
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"{what} {value!r} is not a non-negative integer (got a {type(value).__name__})"
            ) from None
        if not number.is_integer():
            raise ValueError(f"{what} {value!r} is not an integer") from None
        out = int(number)
    if out < 0:
        raise ValueError(f"{what} {value!r} is negative")
    return out


def _config_id(value: Any, field_name: str) -> int:
    """A configured id or rank: a non-negative int (numpy integers too); bool refused."""
    if isinstance(value, bool):
        raise CaptureConfigError(f"{field_name}: {value!r} is a bool, not a non-negative int")
    try:
        out = operator.index(value)
    except TypeError:
        raise CaptureConfigError(
            f"{field_name}: {value!r} is not a non-negative int (got a {type(value).__name__})"
        ) from None
    if out < 0:
        raise CaptureConfigError(f"{field_name}: {value!r} is negative; ids are non-negative ints")
    return out


def _collection(value: Any, field_name: str, form: str) -> list[Any]:
    """The items of a configured collection; a str (or bytes, or a mapping) is refused
    rather than iterated: ``steps=["12"]`` or ``rollouts="12"`` must not mean 1 and 2."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise CaptureConfigError(
            f"{field_name} must be a collection of {form} (or None), got {value!r}"
        )
    return list(value)


def _config_step(item: Any) -> tuple[int, int]:
    """One configured step: a (rollout_id, step_id) pair, or an ``"R:S"`` string as in
    TRAJSTORE_CAPTURE_STEPS."""
    if isinstance(item, str):
        m = _STEP.fullmatch(item.strip())
        if m and item.strip().isascii():
            return int(m.group(1)), int(m.group(2))
    elif not isinstance(item, (bytes, Mapping)) and isinstance(item, Iterable):
        pair = list(item)
        if len(pair) == 2:
            return _config_id(pair[0], "steps"), _config_id(pair[1], "steps")
    raise CaptureConfigError(
        f"steps: item {item!r} is not a (rollout_id, step_id) pair of non-negative ints "
        "or an 'R:S' string (e.g. (120, 0) or '120:0')"
    )


def _config_ranks(value: Any, field_name: str) -> tuple[int, ...]:
    """Configured ranks: a non-empty collection of non-negative ints, sorted, unique."""
    ranks = tuple(
        sorted({_config_id(r, field_name) for r in _collection(value, field_name, "ranks")})
    )
    if not ranks:
        raise CaptureConfigError(
            f"{field_name} is empty: no rank would write; give the ranks (or None)"
        )
    return ranks


#: every variable of ENV_VARS; a TRAJSTORE_CAPTURE* name outside it is a typo
_KNOWN_VARS = frozenset(name for names in ENV_VARS.values() for name in names)


def _refuse_unknown(env: Mapping[str, str]) -> None:
    """A misspelt ``TRAJSTORE_CAPTURE*`` variable (``..._STPES``) would be ignored and the
    run captured with the default instead: refuse it, naming the known ones. (The
    producer's ``RELAX_REPLAY_*`` family has variables of its own: not checked.)"""
    stray = sorted(n for n in env if n.startswith("TRAJSTORE_CAPTURE") and n not in _KNOWN_VARS)
    if stray:
        known = ", ".join(sorted(n for n in _KNOWN_VARS if n.startswith("TRAJSTORE_CAPTURE")))
        raise CaptureConfigError(f"unknown capture variable {stray[0]} (known: {known})")


def _read(env: Mapping[str, str], key: str) -> tuple[str, str] | None:
    """(variable name, value) of a setting; conflicting spellings refused."""
    found = [(name, env[name]) for name in ENV_VARS[key] if name in env]
    if not found:
        return None
    if len({v.strip() for _, v in found}) > 1:
        names = " and ".join(f"{n}={v!r}" for n, v in found)
        raise CaptureConfigError(f"conflicting capture settings: {names}")
    return found[0]


@dataclass(frozen=True)
class CaptureConfig:
    """Everything a `CaptureManager` needs; validated on construction.

    ``rank``/``producer_ranks``: this process and every rank that writes a
    shard of each step-level bundle. With more than one producer each rank
    writes ``rank-<r>/`` and the last to finish publishes the cohort.
    ``rollout_ranks`` (default: ``producer_ranks``) produce rollout bundles;
    give ``[0]`` when only rank 0 sees whole semantic groups.
    ``parallel`` is identity.rank: the world sizes ``{dp, tp, pp, cp}``.
    """

    enabled: bool = False
    output_dir: Path | None = None
    store_dir: Path | str | None = None  # a directory, or an s3:// URL (kept as text)
    run: str = DEFAULT_RUN
    steps: frozenset[tuple[int, int]] | None = None
    rollouts: frozenset[int] | None = None
    queue_size: int = DEFAULT_QUEUE_SIZE
    block: bool = False
    #: "process": a process of its own writes the bundles (`trajstore.capture.
    #: writer_process`: its Python holds no GIL the training loop needs); "thread": a thread
    #: of the training process does (the default where pipes cannot be passed: not POSIX)
    writer: str = DEFAULT_WRITER
    #: fsync each bundle written (directory or staging) so that it survives a power loss
    #: or an OS crash (`trajstore.bundle.writer`). Off by default: the fsyncs cost a fast
    #: trainer several percent, and without them a crash of the training process still
    #: never leaves a partial bundle, and a bundle torn by an OS crash is refused by its
    #: hashes. Into a store, only the staged copy is concerned: the ingest is durable.
    durable: bool = False
    redaction: RedactionPolicy = field(default_factory=RedactionPolicy)
    rank: int | None = None
    producer_ranks: tuple[int, ...] | None = None
    rollout_ranks: tuple[int, ...] | None = None
    parallel: Mapping[str, int] | None = None
    producer_commit: str = ""
    #: the ranks of one launch share it (an s3:// store keys cohort shards by it)
    session: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.output_dir is not None:
            set_(self, "output_dir", user_path(self.output_dir))
        if self.store_dir is not None and not str(self.store_dir).startswith("s3://"):
            set_(self, "store_dir", user_path(self.store_dir))
        for name in ("enabled", "block", "durable"):
            if not isinstance(getattr(self, name), bool):
                raise CaptureConfigError(
                    f"{name} must be True or False, got {getattr(self, name)!r} "
                    "(a string such as 'false' would count as true)"
                )
        if self.steps is not None:
            form = "(rollout_id, step_id) pairs"
            steps = frozenset(_config_step(i) for i in _collection(self.steps, "steps", form))
            set_(self, "steps", steps)
        if self.rollouts is not None:
            items = _collection(self.rollouts, "rollouts", "non-negative int rollout ids")
            set_(self, "rollouts", frozenset(_config_id(r, "rollouts") for r in items))
        if self.enabled and self.steps == frozenset() and self.rollouts == frozenset():
            raise CaptureConfigError(
                "steps and rollouts are both empty: capture is on but would write nothing "
                "(None means every step / every rollout)"
            )
        if self.writer not in WRITERS:
            raise CaptureConfigError(
                f"writer must be one of {', '.join(WRITERS)}, got {self.writer!r}"
            )
        try:
            set_(self, "redaction", RedactionPolicy.parse(self.redaction))
        except UsageError as exc:
            raise CaptureConfigError(f"redaction: {exc}") from None
        if self.session is not None and not _RUN.fullmatch(str(self.session)):
            raise CaptureConfigError(
                f"session {self.session!r} must be 1-128 letters, digits, '.', '_' or '-'"
            )
        if not isinstance(self.run, str) or not _RUN.fullmatch(self.run):
            raise CaptureConfigError(
                f"run name {self.run!r} must be 1-128 characters "
                "of letters, digits, '.', '_' or '-'"
            )
        if not isinstance(self.producer_commit, str) or not _COMMIT.fullmatch(self.producer_commit):
            raise CaptureConfigError(
                f"producer_commit {self.producer_commit!r} is not a commit id: a str of "
                "up to 64 of [0-9A-Za-z._-] (a path or URL would be written verbatim)"
            )
        if (
            isinstance(self.queue_size, bool)
            or not isinstance(self.queue_size, int)
            or self.queue_size < 1
        ):
            raise CaptureConfigError(
                f"queue_size must be a positive integer, got {self.queue_size!r}"
            )
        if self.enabled and (self.output_dir is None) == (self.store_dir is None):
            raise CaptureConfigError(
                "capture is on but needs exactly one destination: TRAJSTORE_CAPTURE_DIR "
                "(bundle directories) or TRAJSTORE_CAPTURE_STORE (a store)"
            )
        if self.enabled:
            self._check_destination()
        if self.rank is not None:
            set_(self, "rank", _config_id(self.rank, "rank"))
        ranks = self.producer_ranks
        if ranks is not None:
            ranks = _config_ranks(ranks, "producer_ranks")
            set_(self, "producer_ranks", ranks)
        if ranks is not None and len(ranks) > 1 and self.rank not in ranks:
            raise CaptureConfigError(
                f"rank {self.rank!r} is not among producer_ranks {list(ranks)}"
            )
        if self.rollout_ranks is not None:
            set_(self, "rollout_ranks", _config_ranks(self.rollout_ranks, "rollout_ranks"))
        if self.parallel is not None and not isinstance(self.parallel, Mapping):
            raise CaptureConfigError(
                f"parallel must be a mapping such as {{'dp': 2, 'tp': 1}}, got {self.parallel!r}"
            )
        for k, v in (self.parallel or {}).items():
            if (
                k not in ("dp", "tp", "pp", "cp")
                or isinstance(v, bool)
                or not isinstance(v, int)
                or v < 1
            ):
                raise CaptureConfigError(
                    f"parallel[{k!r}]={v!r}: keys dp/tp/pp/cp, positive int world sizes"
                )

    def _check_destination(self) -> None:
        """A local destination that can never be written (a file, or under one) stops the
        run now: the writer thread would otherwise count an error per bundle, for days."""
        from trajstore.jsonio import check_creatable

        dest = self.output_dir if self.output_dir is not None else self.store_dir
        if not isinstance(dest, Path):
            return  # an s3:// store: reached when the manager opens it
        what = "output_dir" if self.output_dir is not None else "store_dir"
        if dest.exists() and not dest.is_dir():
            raise CaptureConfigError(f"{what} {dest}: exists and is not a directory")
        try:
            check_creatable(dest)
        except UsageError as exc:
            raise CaptureConfigError(f"{what}: {exc}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CaptureConfig:
        """Read the capture variables (see module doc); ``overrides`` win."""
        env = os.environ if environ is None else environ
        _refuse_unknown(env)
        kw: dict[str, Any] = {}
        got = _read(env, "enabled")
        if got:
            kw["enabled"] = parse_bool(got[1], got[0])
        for key in ("output_dir", "store_dir"):
            got = _read(env, key)
            if got and got[1].strip():
                text = got[1].strip()
                remote = key == "store_dir" and text.startswith("s3://")
                kw[key] = text if remote else Path(text)
        got = _read(env, "steps")
        if got:
            kw["steps"] = parse_steps(got[1], got[0])
        got = _read(env, "rollouts")
        if got:
            kw["rollouts"] = parse_rollouts(got[1], got[0])
        got = _read(env, "run")
        if got:
            kw["run"] = got[1].strip()
        got = _read(env, "queue_size")
        if got:
            text = got[1].strip()
            if not (text.isascii() and text.isdigit()) or int(text) < 1:
                raise CaptureConfigError(f"{got[0]}={got[1]!r} is not a positive integer")
            kw["queue_size"] = int(text)
        got = _read(env, "block")
        if got:
            kw["block"] = parse_bool(got[1], got[0])
        got = _read(env, "durable")
        if got:
            kw["durable"] = parse_bool(got[1], got[0])
        got = _read(env, "writer")
        if got:
            kw["writer"] = got[1].strip().lower()
            if kw["writer"] not in WRITERS:
                raise CaptureConfigError(
                    f"{got[0]}={got[1]!r} is not a writer (one of {', '.join(WRITERS)})"
                )
        got = _read(env, "redaction")
        if got:
            try:
                kw["redaction"] = RedactionPolicy.parse(got[1])
            except UsageError as exc:
                raise CaptureConfigError(f"{got[0]}: {exc}") from None
        got = _read(env, "producer_commit")
        if got:
            commit = got[1].strip()
            if not _COMMIT.fullmatch(commit):
                raise CaptureConfigError(
                    f"{got[0]}={got[1]!r} is not a commit id (up to 64 of [0-9A-Za-z._-])"
                )
            kw["producer_commit"] = commit
        got = _read(env, "session")
        if got and got[1].strip():
            kw["session"] = got[1].strip()
        kw.update(overrides)
        return cls(**kw)

    def with_rank(self, rank: int | None, producer_ranks: Iterable[int] | None) -> CaptureConfig:
        return replace(
            self,
            rank=rank,
            producer_ranks=None if producer_ranks is None else tuple(producer_ranks),
        )

    @property
    def multi_rank(self) -> bool:
        return self.producer_ranks is not None and len(self.producer_ranks) > 1

    def wants_step(self, rollout_id: Any, step_id: Any) -> bool:
        """Whether step ``(rollout_id, step_id)`` is captured; ids as `normalize_id` reads
        them (ValueError for one it refuses), so ``"0"`` or a tensor matches like 0."""
        if not self.enabled:
            return False
        key = (normalize_id(rollout_id, "rollout id"), normalize_id(step_id, "step id"))
        return self.steps is None or key in self.steps

    def wants_rollout(self, rollout_id: Any) -> bool:
        """Whether rollout ``rollout_id`` is captured by this rank (ids as in `wants_step`)."""
        if not self.enabled:
            return False
        rollout_id = normalize_id(rollout_id, "rollout id")
        if self.rollouts is not None and rollout_id not in self.rollouts:
            return False
        ranks = self.rollout_ranks if self.rollout_ranks is not None else self.producer_ranks
        return ranks is None or self.rank is None or self.rank in ranks
