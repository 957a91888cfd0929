"""Content-addressed object space: immutable byte strings named by their BLAKE3 hash.

`ObjectStore` is the interface the rest of trajstore programs against. The
stores of a store directory and of an S3 bucket are one `PackedObjectStore`
(`trajstore.cas.packed`: small objects packed, large ones loose) over a raw
backend (`trajstore.cas.local.LocalObjectStore`, `trajstore.cas.s3.S3ObjectStore`).
`MemoryObjectStore` is a dict, for tests and scratch work.

Every read is verified against the name, so corruption is a clear
IntegrityError naming the object, never wrong numbers.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import astuple, dataclass
from types import TracebackType

from blake3 import blake3

from trajstore.errors import IntegrityError, NotFoundError, TrajstoreError

HASH_RE = re.compile(r"[0-9a-f]{64}\Z")


def object_hash(data: bytes | bytearray | memoryview) -> str:
    """The name of an object: BLAKE3 hex digest (64 lowercase hex chars) of its bytes."""
    return blake3(data).hexdigest()


def check_hash(h: object) -> str:
    """Return `h` if it is a well-formed object name; refuse anything else (e.g. paths)."""
    if not isinstance(h, str) or not HASH_RE.match(h):
        raise NotFoundError(f"not an object hash: {str(h)[:80]!r}")
    return h


def verified(h: str, data: bytes, where: str) -> bytes:
    """`data` if it hashes to `h`; an IntegrityError naming `h` and `where` otherwise."""
    if blake3(data).digest() != bytes.fromhex(h):
        actual = object_hash(data)
        raise IntegrityError(f"object {h} is corrupt ({where}): its content hashes to {actual}")
    return data


@dataclass(frozen=True)
class ObjectInfo:
    """One stored copy of an object. `location` is backend-specific (a relative path here)."""

    hash: str
    size: int
    mtime: float
    location: str


@dataclass(frozen=True)
class RepackResult:
    """What a `repack` pass changed, for GC reporting."""

    packs_rewritten: int = 0
    objects_dropped: int = 0
    bytes_freed: int = 0
    files_removed: int = 0

    def __add__(self, other: RepackResult) -> RepackResult:
        return RepackResult(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


class ObjectStore(ABC):
    """Immutable, verified, write-if-absent bytes keyed by BLAKE3.

    Writes may be buffered: an object is durable after `flush()` (or leaving
    the context manager), and visible to this instance at once.
    """

    @abstractmethod
    def put(self, data: bytes) -> str:
        """Store `data` if absent; return its hash. Cheap when already present."""

    def put_many(self, datas: Iterable[bytes]) -> list[str]:
        return [self.put(d) for d in datas]

    def put_many_added(self, datas: Iterable[bytes]) -> list[tuple[str, bool]]:
        """Store each of `datas` if absent: (hash, whether this call stored it) per item.

        What ingest records as the bytes a bundle *added* (the rest it references were
        already stored). Backends answer under the lock that decides the write; this
        default asks `has` first (two writers racing may both count an object).
        """
        out: list[tuple[str, bool]] = []
        seen: set[str] = set()
        for d in datas:
            h = object_hash(d)
            new = h not in seen and not self.has(h)
            seen.add(h)
            out.append((self.put(d), new))
        return out

    @abstractmethod
    def get(self, h: str) -> bytes:
        """Bytes of object `h`, verified. NotFoundError if absent, IntegrityError if corrupt."""

    def get_many(self, hashes: Sequence[str]) -> list[bytes]:
        return [self.get(h) for h in hashes]

    @abstractmethod
    def has(self, h: str) -> bool:
        """Whether `h` is stored (a buffered object counts)."""

    def has_cached(self, h: str, size: int) -> bool:
        """Whether `h` is stored, known without any I/O (False when unsure): a writer may
        then skip encoding and putting it. `size` (its length) is for wrappers that
        account the bytes a writer names."""
        return False

    @abstractmethod
    def iter_objects(self) -> Iterator[ObjectInfo]:
        """Every stored copy (a hash may appear more than once after concurrent writes)."""

    @abstractmethod
    def delete_many(self, hashes: Iterable[str]) -> int:
        """Remove every copy of these objects now; return the number of copies removed.

        No grace period: this is the primitive a GC policy calls, not a policy.
        """

    def missing(self, hashes: Iterable[str]) -> set[str]:
        """Those of `hashes` that no stored copy holds: what gc checks the live set against
        before it deletes anything. Backends answer from their object index and one listing,
        not a read per object; the default asks `has` for each."""
        return {h for h in set(hashes) if not self.has(h)}

    def verify(self, h: str) -> None:
        """Raise IntegrityError (naming `h`) unless the stored copy matches its hash."""
        self.get(h)

    def verify_many(self, hashes: Sequence[str]) -> dict[str, str]:
        """Verify each object; return the problem (one line) of each that fails, by hash.

        Backends whose reads cost a request (S3) batch this; the default verifies one by one.
        """
        problems: dict[str, str] = {}
        for h in hashes:
            try:
                self.verify(h)
            except TrajstoreError as e:
                problems[h] = str(e)
        return problems

    def flush(self) -> None:
        """Make every buffered object durable. No-op for unbuffered backends."""
        return None

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # On error, still seal what was written: objects are immutable and
        # unreferenced ones are ordinary garbage for GC.
        self.close()


class MemoryObjectStore(ObjectStore):
    """Objects in a dict. Reads are verified like any backend (tests corrupt `data`)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._mtime: dict[str, float] = {}

    def put(self, data: bytes) -> str:
        return self.put_many_added([data])[0][0]

    def put_many_added(self, datas: Iterable[bytes]) -> list[tuple[str, bool]]:
        out = []
        for data in datas:
            h = object_hash(data)
            new = h not in self.data
            if new:
                self.data[h] = bytes(data)
                self._mtime[h] = time.time()
            out.append((h, new))
        return out

    def get(self, h: str) -> bytes:
        try:
            data = self.data[check_hash(h)]
        except KeyError:
            raise NotFoundError(f"object {h} not found in memory store") from None
        return verified(h, data, "memory")

    def has(self, h: str) -> bool:
        return h in self.data

    def iter_objects(self) -> Iterator[ObjectInfo]:
        for h, d in list(self.data.items()):
            yield ObjectInfo(h, len(d), self._mtime.get(h, 0.0), "memory")

    def delete_many(self, hashes: Iterable[str]) -> int:
        n = 0
        for h in hashes:
            if self.data.pop(h, None) is not None:
                self._mtime.pop(h, None)
                n += 1
        return n
