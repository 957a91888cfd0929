"""The conversion layer every framework adapter shares (docs/architecture.md, "How to add a
framework adapter").

A trainer hands over padded ``[B, L]`` tensors, group ids, masks, a config and sometimes
routes; a bundle wants flat per-sample payloads, sample and micro-batch ids, the settings
that fix the math and ``[T, L, K]`` routes. That conversion is written here once; an
adapter (`trajstore.integrations.trl`, ``verl/``, ``slime/``, ``engines``, ``hf_moe``)
names its framework's fields and calls it:

- `FrameworkAdapter`: the small abstract base (the framework's import name, its extra and
  the release it was written against; `FrameworkAdapter.require` imports it lazily with an
  install hint, `FrameworkAdapter.warn_untested` says once when another release runs);
- padded to per-sample: `keep_mask`, `pack`, `per_token`, `last_token_lengths`;
- identity: `groups_of_uids`, `group_of_position`, `SampleIds`, `micro_batch_id`;
- config capture: `plain`, `config_get`;
- routes: `trim_routes`, `route_dtype`, and for engines that route input positions only,
  `with_final_rows` / `blank_final_rows` (the last token's row ``-1``);
- writing: `StepRecord` and `write_step` (one step bundle of micro-batches).

Nothing here imports a framework, and torch only inside the functions that take tensors
(the engine decoders run on NumPy alone).
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import numpy as np

from trajstore.vocab import Stage

logger = logging.getLogger("trajstore.capture")

__all__ = [
    "FrameworkAdapter",
    "SampleIds",
    "StepRecord",
    "blank_final_rows",
    "config_get",
    "cpu",
    "group_of_position",
    "groups_of_uids",
    "keep_mask",
    "last_token_lengths",
    "micro_batch_id",
    "pack",
    "per_token",
    "plain",
    "route_dtype",
    "trim_routes",
    "with_final_rows",
    "write_step",
]


# --------------------------------------------------------------------------- the base


class FrameworkAdapter(ABC):
    """What trajstore knows of one framework: how to import it, which release the adapter
    reads, and which of its settings fix the math.

    A subclass sets the class attributes and implements `recompute_config`; one instance
    per framework lives in its adapter module (``TRL`` in ``trl.py``, ``VERL`` in
    ``verl/records.py``, ...).
    """

    #: the name messages use ("TRL", "verl")
    name: ClassVar[str]
    #: the import name and the distribution (None: nothing to import, a dump format)
    module: ClassVar[str | None] = None
    distribution: ClassVar[str | None] = None
    #: the trajstore extra that installs it (``pip install 'trajstore[<extra>]'``)
    extra: ClassVar[str | None] = None
    #: the release the adapter was written against (others: a warning at capture)
    tested: ClassVar[str | None] = None

    def __init__(self) -> None:
        self._warned = False
        self._version: tuple[str | None] | None = None  # (release,) once read

    @property
    def install_hint(self) -> str:
        return f"pip install 'trajstore[{self.extra or self.module}]'"

    def require(self) -> ModuleType:
        """The framework's module, or an ImportError that says how to install it."""
        import importlib

        if self.module is None:
            raise ImportError(f"the {self.name} integration imports no framework")
        try:
            return importlib.import_module(self.module)
        except ImportError as exc:
            raise ImportError(
                f"the {self.name} integration needs {self.module}: {self.install_hint}"
            ) from exc

    def installed_version(self) -> str | None:
        """The installed release, read from its metadata without importing it, once per
        process: every captured step names it, and reading the metadata (a scan of the
        installed distributions) cost about 1.2 ms a step on the training thread."""
        if self._version is None:
            from importlib.metadata import PackageNotFoundError, version

            name = self.distribution or self.module
            try:
                self._version = (None if name is None else version(name),)
            except PackageNotFoundError:
                self._version = (None,)
        return self._version[0]

    def is_tested(self, version: str | None) -> bool:
        """True for the tested release (or a patch of it) and for an unknown one."""
        if not version or not self.tested:
            return True
        return version == self.tested or version.startswith(self.tested + ".")

    def warn_untested(self, version: str | None = None) -> None:
        """Log once per adapter that the running release is not the tested one."""
        version = self.installed_version() if version is None else version
        if self._warned or self.is_tested(version):
            return
        self._warned = True
        logger.warning(
            "trajstore: %s capture is written against %s %s; this is %s",
            self.name,
            self.name,
            self.tested,
            version,
        )

    @abstractmethod
    def recompute_config(self, source: Any, **options: Any) -> dict[str, Any]:
        """The settings of a run that determine its math, as a bundle's ``config``."""


# --------------------------------------------------------------------------- padded -> per sample


def cpu(tensor: Any) -> Any:
    """A CPU copy that no later in-place update can reach, outside any graph."""
    return tensor.detach().to("cpu", copy=True)


def keep_mask(lengths: Any, width: int) -> Any:
    """``[B, width]`` booleans: True on each row's first ``lengths[b]`` positions (a
    right-padded batch's real tokens)."""
    import torch

    lengths = torch.as_tensor(lengths)
    return torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)


def pack(padded: Any, keep: Any) -> Any:
    """Padded ``[B, L]`` values as flat per-sample values (row-major: sample 0, 1, ...)."""
    return cpu(padded)[keep]


def per_token(values: Any, lengths: Any) -> Any:
    """One value per sample repeated over its tokens (flat, sample after sample)."""
    import torch

    return torch.repeat_interleave(torch.as_tensor(values), torch.as_tensor(lengths))


def last_token_lengths(mask: Any) -> Any:
    """Each row's length up to its last nonzero mask entry (trailing masked tokens are
    padding to a trainer that does not say where a response ends)."""
    import torch

    horizon = int(mask.shape[-1])
    positions = torch.arange(1, horizon + 1).unsqueeze(0) * (mask != 0)
    return positions.max(dim=-1).values


# --------------------------------------------------------------------------- identity


def groups_of_uids(uids: Any, rows: int) -> list[int]:
    """Group ids in order of first appearance of each uid (None: one group a sample)."""
    if uids is None:
        return list(range(rows))
    seen: dict[Any, int] = {}
    return [seen.setdefault(_hashable(uid), len(seen)) for uid in list(uids)]


def _hashable(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def group_of_position(batch: int, row: int, rows: int, group_size: int) -> int:
    """The group of row ``row`` of generation batch ``batch`` (``rows`` rows, consecutive
    groups of ``group_size``), numbered across batches."""
    return batch * (rows // group_size) + row // group_size


class SampleIds:
    """Sample ids within one step: a row consumed again (several epochs or iterations over
    one batch) gets ``-it<n>`` from its second use on."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}

    def __call__(self, base: str, row: int) -> str:
        self._seen[row] = self._seen.get(row, 0) + 1
        return base if self._seen[row] == 1 else f"{base}-it{self._seen[row]}"


def micro_batch_id(number: int) -> str:
    """The ``number``-th micro-batch of a step, in the order the loss consumed them."""
    return f"mb-{number:04d}"


# --------------------------------------------------------------------------- config capture


def plain(obj: Any) -> Any:
    """A JSON-able copy of a config node: OmegaConf, dataclass, mapping, list or scalar."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if type(obj).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf  # present wherever such a node is

        return plain(OmegaConf.to_container(obj, resolve=True))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping) or hasattr(obj, "items"):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def config_get(node: Any, path: str, default: Any = None) -> Any:
    """``node.a.b`` for a dotted path over mappings, OmegaConf nodes and dataclasses."""
    for part in path.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or hasattr(node, "get") and not dataclasses.is_dataclass(node):
            node = node.get(part)
        else:
            node = getattr(node, part, None)
    return default if node is None else node


# --------------------------------------------------------------------------- routes


def trim_routes(routes: Any, real: Any) -> Any:
    """``[B, S, L, K]`` routes over a ``[B, >=S]`` mask of real tokens -> the bundle's
    ``[T, L, K]`` int32, sample after sample (a route tensor may stop before the mask's
    last position: the last token is never fed back)."""
    import torch

    experts = cpu(routes)
    keep = torch.as_tensor(real).bool()[:, : experts.shape[1]]
    return experts[keep].to(torch.int32)


def route_dtype(num_experts: int, *, signed: bool = False) -> np.dtype:
    """The smallest integer dtype for expert ids below ``num_experts``: unsigned (uint8 up
    to 255 experts, then int16, int32), or ``signed`` to hold ``-1`` (no route) too."""
    if signed:
        for dtype in (np.int8, np.int16, np.int32):
            if num_experts - 1 <= np.iinfo(dtype).max:
                return np.dtype(dtype)
        raise ValueError(f"{num_experts} experts do not fit int32 ids")
    if num_experts <= np.iinfo(np.uint8).max:
        return np.dtype(np.uint8)
    return np.dtype(np.int16) if num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)


def with_final_rows(parts: Sequence[Any], tail: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Per-sample routes with one row per *input* position (``[T_i - 1, L, K]``: an engine
    never feeds a sample's last token back) as the bundle's ``[T, L, K]`` in ``dtype``, each
    sample's last row ``-1`` (no route)."""
    out = []
    for rows in parts:
        full = np.full((len(rows) + 1, *tail), -1, dtype=dtype)
        full[:-1] = rows
        out.append(full)
    return np.concatenate(out) if out else np.zeros((0, *tail), dtype=dtype)


def blank_final_rows(routes: Any, total_lengths: Sequence[int]) -> np.ndarray:
    """A signed copy of ``[T, L, K]`` routes with each sample's last row ``-1``: the side of
    a comparison whose other side has no route for that token (`with_final_rows`)."""
    arr = np.asarray(routes)
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 3:
        raise ValueError(f"routes must be integer [T, L, K], got {arr.dtype} {arr.shape}")
    lengths = np.asarray(total_lengths, dtype=np.int64)
    if (lengths < 1).any() or int(lengths.sum()) != arr.shape[0]:
        raise ValueError(
            f"total_lengths sum to {int(lengths.sum())}, the routes have {arr.shape[0]} rows"
        )
    out = arr.astype(np.promote_types(arr.dtype, np.int8), copy=True)
    out[np.cumsum(lengths) - 1] = -1
    return out


# --------------------------------------------------------------------------- writing


@dataclass
class StepRecord:
    """One optimizer step as a step bundle's contents: micro-batches (``mb_id``,
    ``samples``, ``payloads``, optionally ``routes`` and ``expected``), the loss's expected
    values and the config."""

    rollout_id: int
    step_id: int
    micro_batches: list[dict[str, Any]]
    expected_loss: dict[str, Any]
    recompute: dict[str, Any] = field(default_factory=dict)


def write_step(manager: Any, step: StepRecord, recompute: Mapping[str, Any] | None = None) -> bool:
    """Enqueue one step record on a `CaptureManager` (``recompute`` replaces the record's);
    True when queued, False when the manager does not want the step."""
    config = step.recompute if recompute is None else recompute
    with manager.step(step.rollout_id, step.step_id, recompute=config) as capture:
        if not capture.active:
            return False
        for mb in step.micro_batches:
            routes = mb.get("routes")
            extra = {} if routes is None else {"routes": routes}
            capture.add(mb["mb_id"], samples=mb["samples"], **extra, **mb["payloads"])
        capture.expect(Stage.LOSS_POLICY, step.expected_loss)
    return True


def write_steps(manager: Any, steps: Sequence[StepRecord]) -> int:
    """Enqueue step records; how many were queued."""
    return sum(write_step(manager, step) for step in steps)
