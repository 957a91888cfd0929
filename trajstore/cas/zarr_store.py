"""A read-only zarr-python Store over stored payload arrays, for outside tools.

    store = CASZarrStore(objs, {"log_probs": record})
    z = zarr.open_array(store=store, path="log_probs", mode="r")
    padded = z[:]                      # [num_rows, width, *token_shape], fill 0
    lengths = z.attrs["trajstore"]["row_lengths"]
    sample_i = z[i, : lengths[i]]      # one row's tokens, unpadded

Keys: `zarr.json` (the root group), `<name>/zarr.json` (the array's metadata
object) and `<name>/c/<i>/<j>[/0...]` (chunk objects via the record's chunk
table; all-fill chunks are absent, so zarr reads the fill value). Delta
arrays are served as their values: each chunk is reconstructed from the base
and re-encoded on request; so are the regular-grid windows of an array whose
rows are windowed in two segments (record format 2, `ArrayRecord.heads`).
trajstore itself reads through `arrays.read_rows`, which skips zarr-python's
per-chunk overhead. Object reads are synchronous
(local files); a remote backend would want an async `get_many` here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from trajstore.cas.arrays import ArrayRecord, encode_chunk, read_rows, window_bytes
from trajstore.cas.objects import ObjectStore
from trajstore.errors import StoreError, UsageError

__all__ = ["CASZarrStore"]

_ROOT = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def _grid_windows(rec: ArrayRecord, i: int) -> int:
    """Windows of row i in zarr's regular chunk grid (`[1, W, ...]`)."""
    return -(-rec.row_lengths[i] // rec.chunk_tokens)


class CASZarrStore(Store):
    """Read-only `zarr.abc.store.Store`: array `name` of `arrays` at path `name`."""

    supports_writes: bool = False
    supports_deletes: bool = False
    supports_listing: bool = True

    def __init__(self, objs: ObjectStore, arrays: Mapping[str, ArrayRecord]) -> None:
        super().__init__(read_only=True)
        for name, rec in arrays.items():
            if not name or "/" in name or name in (".", "..", "zarr.json", "c"):
                raise UsageError(f"array name {name!r} must be one plain path segment")
            rec.check()
        self._objs = objs
        self._arrays = dict(arrays)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, CASZarrStore)
            and other._objs is self._objs
            and other._arrays == self._arrays
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CASZarrStore({self._objs!r}, arrays={sorted(self._arrays)})"

    def with_read_only(self, read_only: bool = False) -> CASZarrStore:
        if not read_only:
            raise StoreError("CASZarrStore is read-only: objects are immutable")
        return CASZarrStore(self._objs, self._arrays)

    # -- key resolution --

    def _chunk_slot(self, rec: ArrayRecord, parts: list[str]) -> tuple[int, int] | None:
        """(row, window) of chunk key parts `c/i/j/0...`, or None if not a stored chunk."""
        ndim = len(rec.shape)
        if len(parts) != ndim + 1 or parts[0] != "c":
            return None
        try:
            idx = [int(p) for p in parts[1:]]
        except ValueError:
            return None
        i, j, rest = idx[0], idx[1], idx[2:]
        if any(rest) or not 0 <= i < len(rec.chunks) or not 0 <= j < _grid_windows(rec, i):
            return None
        return i, j

    def _resolve(self, key: str) -> bytes | None:
        if key == "zarr.json":
            return _ROOT
        name, _, rest = key.partition("/")
        rec = self._arrays.get(name)
        if rec is None or not rest:
            return None
        if rest == "zarr.json":
            return self._objs.get(rec.meta)
        slot = self._chunk_slot(rec, rest.split("/"))
        if slot is None:
            return None
        i, j = slot
        if rec.heads is not None:  # stored windows are not the grid's: rebuild window j
            row = read_rows(self._objs, rec, [i]).reshape(-1).view("u1")
            size = rec.chunk_bytes
            raw = row[j * size : (j + 1) * size].tobytes()
            return encode_chunk(raw + bytes(size - len(raw)))
        if rec.base is None:
            h = rec.chunks[i][j]
            return None if h is None else self._objs.get(h)
        raw = window_bytes(self._objs, rec, [i])[0][j]
        return None if raw is None else encode_chunk(raw)

    def _keys(self) -> Iterable[str]:
        yield "zarr.json"
        for name, rec in self._arrays.items():
            yield f"{name}/zarr.json"
            tail = "/0" * len(rec.token_shape)
            for i, row in enumerate(rec.chunks):
                if rec.heads is not None:  # every grid window of the row (rebuilt on request)
                    for j in range(_grid_windows(rec, i)):
                        yield f"{name}/c/{i}/{j}{tail}"
                    continue
                for j, h in enumerate(row):
                    # Delta arrays: a window exists unless both delta and base are fill;
                    # listing conservatively names every window of the row.
                    if h is not None or rec.base is not None:
                        yield f"{name}/c/{i}/{j}{tail}"

    # -- Store API --

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        data = self._resolve(key)
        if data is None:
            return None
        if byte_range is not None:
            if isinstance(byte_range, RangeByteRequest):
                data = data[byte_range.start : byte_range.end]
            elif isinstance(byte_range, OffsetByteRequest):
                data = data[byte_range.offset :]
            else:
                data = data[max(len(data) - byte_range.suffix, 0) :]
        return (prototype or default_buffer_prototype()).buffer.from_bytes(data)

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def exists(self, key: str) -> bool:
        return self._resolve(key) is not None

    async def set(self, key: str, value: Buffer) -> None:
        raise StoreError(f"CASZarrStore is read-only: cannot write {key!r}")

    async def delete(self, key: str) -> None:
        raise StoreError(f"CASZarrStore is read-only: cannot delete {key!r}")

    async def list(self) -> AsyncIterator[str]:
        for k in self._keys():
            yield k

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for k in self._keys():
            if k.startswith(prefix):
                yield k

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        seen: set[str] = set()
        for k in self._keys():
            if prefix:
                if not k.startswith(prefix + "/"):
                    continue
                k = k[len(prefix) + 1 :]
            child = k.split("/")[0]
            if child not in seen:
                seen.add(child)
                yield child
