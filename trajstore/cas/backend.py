"""The raw backend a packed object store writes through: bytes under relative keys.

Keys are `/`-separated and relative to the store (`packs/<id>.pack`,
`objects/<h[:2]>/<h>`). A backend knows nothing of hashes, packs or indexes
(`trajstore.cas.packed` does); it reads whole keys or byte ranges, writes a
key whole or not at all, deletes, lists. Two backends: a store directory
(`trajstore.cas.local.LocalFiles`) and an S3 bucket (`trajstore.cas.s3.S3Files`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Backend", "Listed"]


@dataclass(frozen=True)
class Listed:
    """One listed key, with its size and last-modified time (seconds since the epoch)."""

    key: str
    size: int
    mtime: float


class Backend(ABC):
    """Bytes under relative keys. Errors other than absence are one-line StoreErrors or
    the OSError of the local file system (a full disk is reported as such)."""

    #: parallel requests worth making for independent reads (index loads, loose objects)
    concurrency: int = 1
    #: names returned by listings so far (what a command pays for listing)
    listed: int = 0

    @property
    @abstractmethod
    def label(self) -> str:
        """How messages name the whole store (a directory, an s3:// URL)."""

    @abstractmethod
    def where(self, key: str) -> str:
        """How an integrity message names `key`."""

    def locate(self, key: str) -> object:
        """What `corrupt_indexes` lists for `key` (a Path locally, a URL on S3)."""
        return self.where(key)

    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """The bytes of `key`; None if absent."""

    @abstractmethod
    def read_ranges(self, key: str, starts: list[int], ends: list[int]) -> Sequence[bytes]:
        """The byte ranges [start, end) of `key` (shorter where the key is); FileNotFoundError
        if the key is absent."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def existing(self, keys: Iterable[str], folder: str) -> set[str]:
        """Those of `keys` (all under `folder`) that exist: one listing of `folder`."""
        wanted = set(keys)
        return {e.key for e in self.entries(folder) if e.key in wanted}

    @abstractmethod
    def write(self, key: str, pieces: list[bytes]) -> None:
        """Write `key` as the concatenation of `pieces`: whole or not at all, durable on
        return (rewriting equal content is harmless)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; an absent key is fine."""

    def sync(self, folder: str) -> None:  # noqa: B027 (a no-op unless a backend needs it)
        """Make the creations and removals of keys directly in `folder` durable."""

    @abstractmethod
    def names(self, folder: str, after: str | None = None) -> list[str]:
        """Names of the keys directly in `folder` (only those sorting after `after`)."""

    @abstractmethod
    def entries(self, folder: str) -> list[Listed]:
        """Every key under `folder`, with its size and time."""

    def known_size(self, key: str) -> int | None:
        """The size of `key` if known without a request (None otherwise); FileNotFoundError
        if it is known to be absent."""
        return None

    def forget(self, key: str) -> None:  # noqa: B027 (nothing held unless a backend holds it)
        """Release what is held open for `key` (it was removed)."""

    def remove_stale_temp(self, cutoff: float) -> tuple[int, int]:
        """Remove temp files of writes older than `cutoff`: (files, bytes) removed."""
        return 0, 0

    def close(self) -> None:  # noqa: B027
        """Release every handle."""
