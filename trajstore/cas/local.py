"""Objects in a store directory: the local file backend and `LocalObjectStore`.

Small objects are packed (per-object overhead would otherwise dominate: a 4 KiB
chunk as its own file costs a syscall storm and a 4 KiB+ inode), large ones
are loose files (`trajstore.cas.packed`). Every file is written as a temp file
in `tmp/`, fsynced and renamed into place, so a final name never holds a
partial file; the folder is fsynced after the renames that publish.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

from trajstore.cas.backend import Backend, Listed
from trajstore.cas.packed import PackedObjectStore
from trajstore.errors import StoreError

__all__ = ["LocalFiles", "LocalObjectStore"]


class LocalFiles(Backend):
    """Keys as files under `root` (preads through a few cached file descriptors)."""

    def __init__(self, root: Path, *, durable: bool = True, max_open: int = 64) -> None:
        self.root = root
        self.durable = durable
        self._tmp_dir = root / "tmp"
        try:
            for d in (root / "objects", root / "packs", self._tmp_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot use {root} as an object store: {e}") from None
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._max_fds = max_open
        self._fd_lock = threading.Lock()

    @property
    def label(self) -> str:
        return str(self.root)

    def where(self, key: str) -> str:
        return key

    def locate(self, key: str) -> Path:
        return self.root / key

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def _fd(self, key: str) -> int:
        fd = self._fds.get(key)
        if fd is None:
            fd = os.open(self.root / key, os.O_RDONLY)
            self._fds[key] = fd
            if len(self._fds) > self._max_fds:
                os.close(self._fds.popitem(last=False)[1])
        else:
            self._fds.move_to_end(key)
        return fd

    def read_ranges(self, key: str, starts: list[int], ends: list[int]) -> Sequence[bytes]:
        with self._fd_lock:
            fd = self._fd(key)
            return [
                os.pread(fd, end - start, start) for start, end in zip(starts, ends, strict=True)
            ]

    def exists(self, key: str) -> bool:
        return (self.root / key).exists()

    def existing(self, keys: Iterable[str], folder: str) -> set[str]:
        return {k for k in keys if (self.root / k).is_file()}

    def write(self, key: str, pieces: list[bytes]) -> None:
        """temp + fsync + rename: the final name never holds a partial file."""
        final = self.root / key
        final.parent.mkdir(exist_ok=True)
        tmp = self._tmp_dir / f"{os.getpid():x}-{secrets.token_hex(8)}{final.suffix or '.obj'}"
        try:
            with open(tmp, "wb") as f:
                for c in pieces:
                    f.write(c)
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def delete(self, key: str) -> None:
        self.forget(key)
        (self.root / key).unlink(missing_ok=True)

    def sync(self, folder: str) -> None:
        if self.durable:
            fd = os.open(self.root / folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def names(self, folder: str, after: str | None = None) -> list[str]:
        try:
            names = os.listdir(self.root / folder)
        except OSError as e:
            raise StoreError(f"cannot list {self.root / folder}: {e}") from None
        return sorted(n for n in names if after is None or n > after)

    def entries(self, folder: str) -> list[Listed]:
        out = []
        for top, dirs, files in os.walk(self.root / folder):
            dirs.sort()
            rel = Path(top).relative_to(self.root).as_posix()
            for name in sorted(files):
                try:
                    st = os.stat(os.path.join(top, name))
                except FileNotFoundError:
                    continue
                out.append(Listed(f"{rel}/{name}", st.st_size, st.st_mtime))
        return out

    def known_size(self, key: str) -> int:
        return (self.root / key).stat().st_size

    def forget(self, key: str) -> None:
        with self._fd_lock:
            fd = self._fds.pop(key, None)
            if fd is not None:
                os.close(fd)

    def remove_stale_temp(self, cutoff: float) -> tuple[int, int]:
        files = freed = 0
        for p in self._tmp_dir.iterdir():
            try:
                st = p.stat()
                if st.st_mtime >= cutoff:
                    continue
                p.unlink()
            except FileNotFoundError:
                continue
            files += 1
            freed += st.st_size
        return files, freed

    def close(self) -> None:
        with self._fd_lock:
            while self._fds:
                os.close(self._fds.popitem()[1])


class LocalObjectStore(PackedObjectStore):
    """Objects under `root`: `packs/<id>.pack` + `packs/<id>.idx`, loose `objects/<h[:2]>/<h>`.

    `durable=False` skips the fsyncs (scratch stores, tests).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        pack_threshold: int = 1 << 20,
        pack_max_bytes: int = 128 << 20,
        durable: bool = True,
        max_open_packs: int = 64,
    ) -> None:
        self.root = Path(root)
        self.durable = durable
        super().__init__(
            LocalFiles(self.root, durable=durable, max_open=max_open_packs),
            pack_threshold=pack_threshold,
            pack_max_bytes=pack_max_bytes,
        )

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.root)!r})"
