"""The ref space: small named documents whose creation is a commit point.

Objects are named by their content, so any writer may write them any number
of times. Refs, attempt claims, tombstones and replay results are not: each
is created once under a name, and creating it must fail when the name is
taken, so two writers can never both publish one identity. That is the whole
interface (`create_if_absent`, `read`, `list`, `delete`); `LocalRefSpace`
implements it with files (temp + fsync + link), `trajstore.cas.s3.S3RefSpace`
with conditional PUTs (`If-None-Match: *`).

Keys are `/`-separated relative names such as `refs/bundles/<name>.json`.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from trajstore.errors import NotFoundError, StoreError
from trajstore.jsonio import atomic_create, fsync_all, fsync_path, temp_sibling

__all__ = [
    "DocInfo",
    "DocRef",
    "LocalRefSpace",
    "RefSpace",
    "StagedDocs",
]


@dataclass(frozen=True)
class DocInfo:
    """One listed document: its name inside the listed folder and its modification time."""

    name: str
    mtime: float


class RefSpace(ABC):
    """Create-once documents under `/`-separated keys."""

    #: where the space lives, for messages (a directory or an s3:// URL)
    location: str

    @abstractmethod
    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` holding `data`; False (and nothing changed) if it already exists."""

    def create_many_if_absent(self, items: list[tuple[str, bytes]]) -> list[bool]:
        """`create_if_absent` of each (key, data) in order; which ones this call created.

        Every document created is durable on return. A backend may do them as one
        batch (`LocalRefSpace`: one fsync per directory, not one per document).
        """
        return [self.create_if_absent(k, d) for k, d in items]

    def staged(self, items: list[tuple[str, bytes]]) -> StagedDocs:
        """Documents written ahead of their creation, to be created later, some or all, in
        an order the caller decides as it goes (`StagedDocs`). This default creates each
        one, durable, when asked (what a backend without a cheaper batch does)."""
        return StagedDocs(self, items)

    @abstractmethod
    def read(self, key: str) -> bytes:
        """The bytes of `key`; NotFoundError if absent, StoreError if unreadable."""

    @abstractmethod
    def list(self, folder: str) -> list[DocInfo]:
        """Documents directly inside `folder` (finished creates only), sorted by name."""

    def list_names(self, folder: str) -> list[str]:
        """The names of `list` alone (a backend may find them without their times)."""
        return [d.name for d in self.list(folder)]

    def list_new(self, folder: str, seen: set[str]) -> tuple[set[str], list[str]]:
        """Everything `folder` lists now (a set to pass as `seen` next time; it may hold
        names that are not documents) and, sorted, the document names not in `seen`.

        Why: a reader that keeps what it listed last needs only the difference, and a
        backend may find it without building and sorting a list of every name."""
        names = self.list_names(folder)
        return set(names), [n for n in names if n not in seen]

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` if present."""

    @abstractmethod
    def walk(self, folder: str) -> list[DocInfo]:
        """Every document under `folder`, at any depth (names relative to it), sorted."""

    def exists(self, key: str) -> bool:
        try:
            self.read(key)
        except NotFoundError:
            return False
        return True

    def where(self, key: str) -> str:
        """A readable name of `key` for messages."""
        return f"{self.location.rstrip('/')}/{key}"

    def doc(self, key: str) -> DocRef:
        return DocRef(self, key)

    def changed(self, folder: str, stamps: dict[str, int]) -> bool:
        """Whether `folder` may hold documents not listed since `stamps` (the caller's
        memory) was last updated; True when the backend cannot tell cheaply."""
        return True


class StagedDocs:
    """Documents of one batch, staged: `create(i)` creates item i (create-if-absent, the
    commit point; False if its key exists), `sync()` makes every item created so far
    durable, `close()` (or leaving the `with`) drops what was not created.

    Why: a batch's attempt claims, ref guards and refs are each a durable create, and on
    a local store each costs an fsync of its content before its name may exist. Staged,
    the contents of the whole batch are written and fsynced in one round, before any of
    them is created; which ones are then created depends on the creates before them
    (a claim another capture holds means no guard or ref of that attempt).
    This default (any backend) creates and makes durable each item when asked.
    """

    def __init__(self, space: RefSpace, items: list[tuple[str, bytes]]) -> None:
        self.space = space
        self.items = items

    def create(self, i: int) -> bool:
        key, data = self.items[i]
        return self.space.create_if_absent(key, data)

    def sync(self) -> None:
        """Every item created so far is durable on return."""

    def close(self) -> None:
        """Drop what was staged and not created."""

    def __enter__(self) -> StagedDocs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class DocRef:
    """A document of a ref space, readable like a path (`read_bytes`, `str`)."""

    space: RefSpace
    key: str

    def read_bytes(self) -> bytes:
        try:
            return self.space.read(self.key)
        except (NotFoundError, StoreError) as e:
            raise OSError(str(e)) from None

    def __str__(self) -> str:
        return self.space.where(self.key)


class LocalRefSpace(RefSpace):
    """Documents as files under `root` (today's store directory layout)."""

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root)
        self.location = str(self.root)
        self.durable = durable

    def where(self, key: str) -> str:
        return str(self.root / key)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        path = self.root / key
        try:
            return atomic_create(path, data, durable=self.durable)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            return atomic_create(path, data, durable=self.durable)

    def create_many_if_absent(self, items: list[tuple[str, bytes]]) -> list[bool]:
        """Like `create_if_absent` of each item, in order, as one batch: every temp file
        is written and fsynced (on a few threads: their fsyncs share journal commits),
        then each is linked to its name (the commit point, create-if-absent as one by
        one), then each directory linked into is fsynced once. So each document is
        durable before this returns, and its content is durable before its name exists.
        """
        if len(items) < 2:
            return [self.create_if_absent(k, d) for k, d in items]
        tmps: list[Path] = []
        try:
            paths = [self.root / key for key, _ in items]
            for d in {p.parent for p in paths}:
                d.mkdir(parents=True, exist_ok=True)
            for path, (_, data) in zip(paths, items, strict=True):
                tmp = temp_sibling(path)
                tmps.append(tmp)
                with open(tmp, "wb") as f:
                    f.write(data)
            if self.durable:
                fsync_all(tmps)
            created = []
            for tmp, path in zip(tmps, paths, strict=True):
                try:
                    os.link(tmp, path)
                    created.append(True)
                except FileExistsError:
                    created.append(False)
            if self.durable:
                for d in sorted({p.parent for p, c in zip(paths, created, strict=True) if c}):
                    fsync_path(d)
            return created
        finally:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)

    def staged(self, items: list[tuple[str, bytes]]) -> StagedDocs:
        return _LocalStaged(self, items)

    def read(self, key: str) -> bytes:
        path = self.root / key
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"{path} does not exist") from None
        except OSError as e:
            raise StoreError(f"{path} is unreadable: {e}") from None

    def exists(self, key: str) -> bool:
        return (self.root / key).is_file()

    def _documents(self, folder: str) -> list[os.DirEntry]:
        """The entries of `folder` that are documents: files, not dot names (a create in
        progress is a dot-named temp file); none if the folder does not exist."""
        try:
            with os.scandir(self.root / folder) as it:
                return [e for e in it if not e.name.startswith(".") and e.is_file()]
        except FileNotFoundError:
            return []

    def list(self, folder: str) -> list[DocInfo]:
        out = []
        for e in self._documents(folder):
            try:
                out.append(DocInfo(e.name, e.stat().st_mtime))
            except FileNotFoundError:
                continue
        return sorted(out, key=lambda d: d.name)

    def list_names(self, folder: str) -> list[str]:
        """`list`'s names from one directory read: no stat per document (the entry's type
        comes with it), which is most of listing a folder of 100,000 refs."""
        return sorted(e.name for e in self._documents(folder))

    def list_new(self, folder: str, seen: set[str]) -> tuple[set[str], list[str]]:
        """One `listdir` into a set and a set difference, both in C; only the names not in
        `seen` are checked (dot names are creates in progress, a folder is no document):
        at 110,000 refs ~4x less CPU than `list_names`, which checks and sorts them all."""
        try:
            listed = set(os.listdir(self.root / folder))
        except FileNotFoundError:
            return set(), []
        fresh = sorted(
            n for n in listed - seen if not n.startswith(".") and (self.root / folder / n).is_file()
        )
        return listed, fresh

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def walk(self, folder: str) -> list[DocInfo]:
        base = self.root / folder
        out = []
        for p in base.rglob("*") if base.is_dir() else ():
            if p.name.startswith(".") or not p.is_file():
                continue
            try:
                out.append(DocInfo(p.relative_to(base).as_posix(), p.stat().st_mtime))
            except FileNotFoundError:
                continue
        return sorted(out, key=lambda d: d.name)

    #: a directory modified this recently is listed again even if its mtime did not
    #: change (coarse file-system timestamps can hide a second entry made in the same tick)
    RACY_NS = 2_000_000_000

    def changed(self, folder: str, stamps: dict[str, int]) -> bool:
        """One stat: a directory whose mtime is unchanged (and not racy) holds nothing new."""
        try:
            stamp = (self.root / folder).stat().st_mtime_ns
        except FileNotFoundError:
            return True
        if stamps.get(folder) == stamp:
            return False
        if time.time_ns() - stamp > self.RACY_NS:
            stamps[folder] = stamp
        return True


class _LocalStaged(StagedDocs):
    """Staged documents of a `LocalRefSpace`: every temp file written and fsynced at once
    (one round on a few threads), each linked to its name when created (create-if-absent),
    and each directory linked into fsynced once per `sync`."""

    def __init__(self, space: LocalRefSpace, items: list[tuple[str, bytes]]) -> None:
        super().__init__(space, items)
        self.root = space.root
        self.durable = space.durable
        self.paths = [space.root / key for key, _ in items]
        self.tmps: list[Path | None] = []
        self._dirty: set[Path] = set()
        try:
            for d in {p.parent for p in self.paths}:
                d.mkdir(parents=True, exist_ok=True)
            for path, (_, data) in zip(self.paths, items, strict=True):
                tmp = temp_sibling(path)
                self.tmps.append(tmp)
                with open(tmp, "wb") as f:
                    f.write(data)
            if self.durable:
                fsync_all([t for t in self.tmps if t is not None])
        except BaseException:
            self.close()
            raise

    def create(self, i: int) -> bool:
        tmp, path = self.tmps[i], self.paths[i]
        if tmp is None:
            raise StoreError(f"{path}: staged document already used")
        self.tmps[i] = None
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self._dirty.add(path.parent)
        return True

    def sync(self) -> None:
        if self.durable:
            for d in sorted(self._dirty):
                fsync_path(d)
        self._dirty.clear()

    def close(self) -> None:
        for i, tmp in enumerate(self.tmps):
            if tmp is not None:
                tmp.unlink(missing_ok=True)
                self.tmps[i] = None
