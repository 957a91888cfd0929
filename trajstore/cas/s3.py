"""Objects and refs in an S3-compatible bucket (`s3://BUCKET/PREFIX`), through obstore.

`S3ObjectStore` is the packed object store (`trajstore.cas.packed`, the same
packs, index format and verification as a store directory) over `S3Files`, the
bucket as a raw backend: reads fetch only the byte ranges of the objects asked
for (ranged GETs, nearby ranges merged), never whole packs.

Refs and claims go through `S3RefSpace`: `create_if_absent` is a PUT with
`If-None-Match: *`, so of two writers exactly one creates a name. Blob
uploads are ordinary PUTs: rewriting equal content is harmless.

Endpoint and credentials come only from the environment (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
`AWS_REGION`), never from flags that `ps` would show; an `http://` endpoint
is refused unless `AWS_ALLOW_HTTP=true`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajstore.cas.backend import Backend, Listed
from trajstore.cas.packed import PackedObjectStore
from trajstore.errors import NotFoundError, StoreError, UsageError
from trajstore.refspace import DocInfo, RefSpace

__all__ = [
    "S3Files",
    "S3Location",
    "S3ObjectStore",
    "S3RefSpace",
    "is_s3_url",
    "parse_s3_url",
    "s3_client",
]


def is_s3_url(text: object) -> bool:
    return isinstance(text, str) and text.startswith("s3://")


@dataclass(frozen=True)
class S3Location:
    """`s3://BUCKET/PREFIX`: the bucket and the key prefix (empty or ending in `/`)."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def parse_s3_url(url: str) -> S3Location:
    """Split `s3://BUCKET[/PREFIX]`; a UsageError for anything else."""
    if not is_s3_url(url):
        raise UsageError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket or "/" in bucket:
        raise UsageError(f"{url!r}: give the store as s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UsageError(f"{url!r}: the prefix has an empty, '.' or '..' part")
    return S3Location(bucket, f"{prefix}/" if prefix else "")


def s3_client(bucket: str) -> Any:
    """An obstore S3Store for `bucket`, configured from the standard AWS variables only."""
    from obstore.store import S3Store

    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL") or None
    allow_http = env.get("AWS_ALLOW_HTTP", "").strip().lower() == "true"
    if endpoint is not None and endpoint.startswith("http://") and not allow_http:
        raise UsageError(
            f"AWS_ENDPOINT_URL is plain http ({endpoint}); set AWS_ALLOW_HTTP=true to allow it"
        )
    kwargs: dict[str, Any] = {"region": env.get("AWS_REGION") or "us-east-1"}
    for var, arg in (
        ("AWS_ACCESS_KEY_ID", "access_key_id"),
        ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
        ("AWS_SESSION_TOKEN", "token"),
    ):
        if env.get(var):
            kwargs[arg] = env[var]
    if endpoint is not None:
        # an S3-compatible server (SeaweedFS, MinIO, ...) serves path-style requests
        kwargs.update(endpoint=endpoint, virtual_hosted_style_request=False)
    options = {"allow_http": True} if allow_http else {}
    try:
        return S3Store(bucket, client_options=options, **kwargs)
    except Exception as e:  # obstore's configuration errors are plain exceptions
        raise UsageError(f"cannot configure S3 access to bucket {bucket!r}: {e}") from None


#: the process whose requests started obstore's runtime (a tokio runtime with its own
#: threads, one per process, started by the first request, not by making a client)
_runtime_pid: int | None = None


def _obstore() -> Any:
    """The obstore module, for a request of this process; a StoreError in a process forked
    from one that had already made requests (its runtime's threads are not in the copy,
    and the copy's first request would wait for them forever)."""
    global _runtime_pid
    import obstore

    pid = os.getpid()
    if _runtime_pid is None:
        _runtime_pid = pid
    elif _runtime_pid != pid:
        raise StoreError(
            f"this process (pid {pid}) was forked from one that had used an s3:// store "
            f"(pid {_runtime_pid}), and S3 requests cannot work in such a copy: start it "
            "with multiprocessing's 'spawn' or 'forkserver' method, or fork before the "
            "first S3 request"
        )
    return obstore


def _store_error(e: BaseException, what: str) -> StoreError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return StoreError(f"S3 {what}: {first[:300]}")


def _list(client: Any, loc: S3Location, prefix: str, after: str | None = None) -> list[dict]:
    """Listing entries of every key under `prefix` (a full key prefix), only those sorting
    after `prefix + after` when given (S3 StartAfter: one request per 1,000 names from there)."""
    obstore = _obstore()

    offset = prefix + after if after else None
    try:
        return [m for batch in obstore.list(client, prefix=prefix, offset=offset) for m in batch]
    except Exception as e:
        raise _store_error(e, f"cannot list s3://{loc.bucket}/{prefix}") from None


class S3RefSpace(RefSpace):
    """Create-once documents as S3 objects under a prefix (conditional PUTs)."""

    def __init__(self, client: Any, loc: S3Location) -> None:
        self.client = client
        self.loc = loc
        self.location = loc.url
        #: names returned by listing requests so far (what a command pays for listing)
        self.listed = 0

    #: a folder listed this recently is not listed again (a listing costs one request per
    #: 1,000 names); writers of this process invalidate, lookups that miss force a listing
    LIST_MAX_AGE_NS = 1_000_000_000

    def _key(self, key: str) -> str:
        return self.loc.prefix + key

    def changed(self, folder: str, stamps: dict[str, int]) -> bool:
        now = time.monotonic_ns()
        last = stamps.get(folder)
        if last is not None and now - last < self.LIST_MAX_AGE_NS:
            return False
        stamps[folder] = now
        return True

    def create_if_absent(self, key: str, data: bytes) -> bool:
        obstore = _obstore()
        from obstore.exceptions import AlreadyExistsError

        try:
            obstore.put(self.client, self._key(key), data, mode="create")
        except AlreadyExistsError:
            return False
        except Exception as e:
            raise _store_error(e, f"cannot create {self.where(key)}") from None
        return True

    def read(self, key: str) -> bytes:
        obstore = _obstore()

        try:
            return bytes(obstore.get(self.client, self._key(key)).bytes())
        except FileNotFoundError:
            raise NotFoundError(f"{self.where(key)} does not exist") from None
        except Exception as e:
            raise _store_error(e, f"cannot read {self.where(key)}") from None

    def list(self, folder: str) -> list[DocInfo]:
        obstore = _obstore()

        prefix = self._key(folder.strip("/") + "/")
        try:
            listing = obstore.list_with_delimiter(self.client, prefix)
        except Exception as e:
            raise _store_error(e, f"cannot list {self.where(folder)}") from None
        self.listed += len(listing["objects"])
        out = [
            DocInfo(m["path"][len(prefix) :], m["last_modified"].timestamp())
            for m in listing["objects"]
            if m["path"].startswith(prefix)
        ]
        return sorted(
            (d for d in out if d.name and not d.name.startswith(".")), key=lambda d: d.name
        )

    def walk(self, folder: str) -> list[DocInfo]:
        prefix = self._key(folder.strip("/") + "/")
        metas = _list(self.client, self.loc, prefix)
        self.listed += len(metas)
        out = [DocInfo(m["path"][len(prefix) :], m["last_modified"].timestamp()) for m in metas]
        return sorted((d for d in out if d.name), key=lambda d: d.name)

    def list_after(self, folder: str, after: str | None) -> list[str]:
        """Names directly inside `folder` that sort after `after` (all when None), sorted:
        one listing that starts there (S3 StartAfter), so an incremental catalog sync
        pays for what is new, not for the whole folder (trajstore.catalog.sync.sync_new)."""
        prefix = self._key(folder.strip("/") + "/")
        metas = _list(self.client, self.loc, prefix, after)
        self.listed += len(metas)
        names = (m["path"][len(prefix) :] for m in metas)
        return sorted(n for n in names if n and "/" not in n and not n.startswith("."))

    def delete(self, key: str) -> None:
        obstore = _obstore()

        try:
            obstore.delete(self.client, self._key(key))
        except FileNotFoundError:
            return
        except Exception as e:
            raise _store_error(e, f"cannot delete {self.where(key)}") from None


class S3Files(Backend):
    """Keys under the bucket's prefix, through obstore (errors become one-line StoreErrors)."""

    #: parallel requests for index loads and loose-object reads
    concurrency = 8

    def __init__(self, client: Any, loc: S3Location) -> None:
        self.client = client
        self.loc = loc
        self.listed = 0

    @property
    def label(self) -> str:
        return self.loc.url

    def where(self, key: str) -> str:
        return f"s3://{self.loc.bucket}/{self.loc.prefix}{key}"

    def _request(self, what: str, key: str, call: str, *args: Any, **kwargs: Any) -> Any:
        """obstore's `call` on `key`; FileNotFoundError passes, anything else is one line."""
        obstore = _obstore()

        try:
            return getattr(obstore, call)(self.client, self.loc.prefix + key, *args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise _store_error(e, f"cannot {what} {self.where(key)}") from None

    def read(self, key: str) -> bytes | None:
        try:
            return bytes(self._request("read", key, "get").bytes())
        except FileNotFoundError:
            return None

    def read_ranges(self, key: str, starts: list[int], ends: list[int]) -> Sequence[bytes]:
        return self._request("read", key, "get_ranges", starts=starts, ends=ends)

    def exists(self, key: str) -> bool:
        try:
            self._request("stat", key, "head")
        except FileNotFoundError:
            return False
        return True

    def write(self, key: str, pieces: list[bytes]) -> None:
        self._request("write", key, "put", b"".join(pieces))

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._request("delete", key, "delete")

    def _listing(self, folder: str, after: str | None = None) -> list[dict]:
        out = _list(self.client, self.loc, f"{self.loc.prefix}{folder}/", after)
        self.listed += len(out)
        return out

    def names(self, folder: str, after: str | None = None) -> list[str]:
        start = len(self.loc.prefix) + len(folder) + 1
        return sorted(m["path"][start:] for m in self._listing(folder, after))

    def entries(self, folder: str) -> list[Listed]:
        start = len(self.loc.prefix)
        return [
            Listed(m["path"][start:], int(m["size"]), m["last_modified"].timestamp())
            for m in self._listing(folder)
        ]


class S3ObjectStore(PackedObjectStore):
    """Content-addressed objects in a bucket: packs with an index object, large objects
    loose; pack indexes kept in `index_cache` (a local directory) when given."""

    def __init__(
        self,
        client: Any,
        loc: S3Location,
        *,
        pack_threshold: int = 1 << 20,
        pack_max_bytes: int = 64 << 20,
        index_cache: Path | None = None,
    ) -> None:
        self.client = client
        self.loc = loc
        super().__init__(
            S3Files(client, loc),
            pack_threshold=pack_threshold,
            pack_max_bytes=pack_max_bytes,
            index_cache=index_cache,
        )

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.loc.url!r})"
