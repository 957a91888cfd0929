"""trajstore: store and replay what asynchronous RL training actually consumed.

Imports here stay light so that `trajstore --help` is instant; heavy modules
(torch, zarr, duckdb) are imported where they are used.
"""

__version__ = "0.1.0"
