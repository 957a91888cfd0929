"""A DuckDB catalog file whose creation failed (a full disk) is removed, not obeyed.

Its own module so both ways of opening a store's catalog (`catalog.db` through
SQLAlchemy, `catalog.direct` through the duckdb module) share it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def drop_stillborn_duckdb(file: Path) -> bool:
    """Remove an empty DuckDB file nobody holds; True if it did.

    DuckDB writes its header as it creates a file, under its own lock, so an empty
    file no process locks is a creation that failed (a full disk) and holds nothing.
    Left in place it fails every later open ("not a valid DuckDB database file");
    removed, the catalog is rebuilt from the refs like a deleted one.
    """
    try:
        if file.stat().st_size != 0:
            return False
        fd = os.open(file, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while DuckDB holds it
        if os.fstat(fd).st_size != 0:
            return False
        file.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
