"""`AppState`: what the endpoints share, provided to them with `Depends`.

The lifespan of the app (`create_app`) opens one `AppState` and puts it on
``app.state``; endpoints declare a `StateDep` parameter instead of reaching
into a closure, so each router module stands alone.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel

from trajstore.errors import StoreError, TrajstoreError
from trajstore.store import Store
from trajstore.store.stored_bundle import StoredBundle

from .errors import ApiError
from .limits import QueueLimitedLock, body_cache_bytes, max_buffered_bytes, serial_build_bytes
from .payloads import Body, BodyCache
from .snapshot import CatalogSnapshot, View

_REF_NAME = re.compile(r"^[0-9]{20}-[0-9]+-[0-9a-f]+\Z")  # \Z: "$" passes a final "\n"
#: stored bundles kept open (refs are immutable, so a cached one never goes stale)
_MAX_OPEN_BUNDLES = 256
_MAX_CAPABILITY_ENTRIES = 10000
#: encoded step/rollout details kept (a few KiB each)
_MAX_DETAILS = 20000
#: values shared by endpoints (a run's verdict rows: ~35,000 tuples at 100,000 steps)
_MAX_SHARED = 8
#: start-up time given to reading the bundles' capabilities (the rest load on first use)
_PRELOAD_CAPABILITIES_S = 5.0


class AppState:
    """The store, its catalog snapshot, and the caches of bundles and bodies."""

    def __init__(
        self,
        store_dir: Path | str,
        token: str | None,
        poll_s: float,
        *,
        catalog_url: str | None = None,
    ) -> None:
        self.store = Store.open(store_dir, create=False, catalog_url=catalog_url)
        self.token = token
        self.snap = CatalogSnapshot(self.store, poll_s=poll_s)
        self._bundles: OrderedDict[str, StoredBundle] = OrderedDict()
        self._capabilities: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        # RefIndex (used by replay) is not thread-safe; a full queue answers 503 busy
        self.replay_lock = QueueLimitedLock()
        self.bodies = BodyCache(body_cache_bytes())
        # payload bodies built in memory: refused over the limit, built one at a time over
        # the threshold, a body being sent shared by ETag (api/routes/bundles.py)
        self.max_buffered_bytes = max_buffered_bytes()
        self.serial_build_bytes = serial_build_bytes()
        self.build_lock = QueueLimitedLock(what="payload bodies over the build threshold")
        self.bodies_in_flight: weakref.WeakValueDictionary[str, Body] = (
            weakref.WeakValueDictionary()
        )
        self._details: OrderedDict[tuple, bytes] = OrderedDict()
        self._details_generation = -1
        self._shared: OrderedDict[tuple, Any] = OrderedDict()
        if not str(store_dir).startswith("s3://"):  # on S3 each manifest is a GET: lazily
            self.preload_capabilities(_PRELOAD_CAPABILITIES_S)

    def detail_json(self, key: tuple, build: Callable[[], BaseModel]) -> bytes:
        """The JSON of a step/rollout detail (or of a run's summary, strip or steps page,
        keyed by route and parameters), built once per catalog generation.

        A lookup's own work (group_detail, then pydantic validation and encoding
        of the response model) was most of its cost under load; the View is
        immutable per generation, so its encoded answer is too. A new generation
        (a sync that applied something) empties the cache.
        """
        return self._per_generation(
            self._details, _MAX_DETAILS, key, lambda: build().model_dump_json().encode()
        )

    def _follow(self, generation: int) -> None:
        """Drop what an older catalog generation built (call with the lock held)."""
        if generation != self._details_generation:
            self._details.clear()
            self._shared.clear()
            self._details_generation = generation

    def generation_value(self, key: tuple, build: Callable[[], Any]) -> Any:
        """A value several endpoints build from (a run's verdict rows: its summary and
        every strip), built once per catalog generation; the newest few are kept."""
        return self._per_generation(self._shared, _MAX_SHARED, key, build)

    def _per_generation(
        self, cache: OrderedDict[tuple, Any], limit: int, key: tuple, build: Callable[[], Any]
    ) -> Any:
        """`cache[key]`, built (outside the lock) when this generation has not yet; the
        newest `limit` entries are kept, and a value built from a generation that a sync
        has meanwhile replaced is returned but not kept."""
        generation = self.view.generation
        with self._lock:
            self._follow(generation)
            if key in cache:
                cache.move_to_end(key)
                return cache[key]
        value = build()
        with self._lock:
            if generation == self._details_generation:
                cache[key] = value
                while len(cache) > limit:
                    cache.popitem(last=False)
        return value

    @property
    def view(self) -> View:
        return self.snap.view

    def stored(self, row: dict[str, Any]) -> StoredBundle:
        """The StoredBundle of a known catalog row (cached; refs are immutable)."""
        name = row["ref_name"]
        with self._lock:
            hit = self._bundles.get(name)
            if hit is not None:
                self._bundles.move_to_end(name)
                return hit
        if not _REF_NAME.match(name):
            raise StoreError(f"catalog holds a malformed ref name {name!r}; run trajstore reindex")
        stored_bundle = StoredBundle(self.store.objs, self.store.refs.read(name), name)
        with self._lock:
            self._bundles[name] = stored_bundle
            while len(self._bundles) > _MAX_OPEN_BUNDLES:
                self._bundles.popitem(last=False)
        return stored_bundle

    def preload_capabilities(self, budget_s: float) -> int:
        """Read the capabilities of the visible bundles now, for at most `budget_s` seconds
        and up to the cache's bound; the number of manifests read.

        Reason: the manifest read was a third of a step's first lookup (after the sample
        digests), paid by every worker for every step. A manifest that cannot be read is
        skipped here; its lookup reports the error as before.
        """
        deadline = time.monotonic() + budget_s
        read = 0
        for row in self.view.bundles.values():
            if read >= _MAX_CAPABILITY_ENTRIES or time.monotonic() > deadline:
                break
            if row["removed_at"] is not None or row.get("manifest_hash") in self._capabilities:
                continue
            try:
                self.capabilities(row)
            except TrajstoreError:
                continue
            read += 1
        return read

    def capabilities(self, row: dict[str, Any]) -> dict[str, str]:
        """Stage -> declared capability of a bundle, from its manifest (cached by hash)."""
        manifest_hash = row.get("manifest_hash")
        if not manifest_hash:
            return {}
        capabilities = self._capabilities.get(manifest_hash)
        if capabilities is None:
            manifest = self.store.load_document(manifest_hash)
            capabilities = {
                stage: str(contract.get("capability"))
                for stage, contract in sorted((manifest.get("stage_contracts") or {}).items())
                if isinstance(contract, dict)
            }
            if len(self._capabilities) > _MAX_CAPABILITY_ENTRIES:
                self._capabilities.clear()
            self._capabilities[manifest_hash] = capabilities
        return capabilities

    def close(self) -> None:
        self.snap.close()
        self.store.close()


async def get_state(request: Request) -> AppState:
    """The app's state; 503 "starting" before the lifespan has opened the store."""
    state = getattr(request.app.state, "trajstore", None)
    if state is None:
        raise ApiError(503, "starting", "the server is starting")
    return state


StateDep = Annotated[AppState, Depends(get_state)]
