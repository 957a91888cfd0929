"""Per-token payloads as Zarr v3 arrays whose chunks are content-addressed objects.

A ragged payload (flat tokens of each row concatenated; rows are samples) is
stored as the padded array `[num_rows, width, *token_shape]` with chunk
`[1, W, *token_shape]`: a window of W tokens of one row. A chunk's bytes then
depend only on that row's own tokens, so a sample recurring in another
bundle, rank, attempt or run is the same object. Chunks whose bytes are all
zero (the fill value) are not stored.

The codec chain is `bytes` (little endian) + `zstd` level 3 without
checksum, so each stored chunk is exactly `zstd.compress(window.tobytes(), 3)`
as zarr-python writes it; we encode and decode directly (zarr-python costs
~0.1-0.7 ms per chunk) and `zarr_store.CASZarrStore` serves the same
objects to stock zarr. A caveat: a different libzstd may emit different (still
valid) bytes, which only costs dedup against objects written before.

W is a store-wide constant so that dedup holds across writers:
`CHUNK_TOKENS_SCALAR` = 4096 for 1-D payloads (16 KiB float32, 8 KiB bf16:
a response of up to 4,096 tokens is one chunk, so a sample is one object and
a bulk read makes ~4x fewer object lookups and decoder calls than with 1024;
dedup is unchanged because a chunk still holds only its own row's tokens),
`CHUNK_TOKENS_TOKENWISE` = 256 for payloads
with per-token shape such as routes [T, L, K] (256 x 384 B = 96 KiB for a
48x8 uint8 capture: compresses well, and a shared prompt covers whole windows).

Writing keys an in-process cache (`ENCODE_CACHE`, 64 MiB) by the BLAKE3 of a
window's decoded bytes: a window seen again (a step's samples after their
rollout bundle) reuses its encoded bytes instead of being compressed again;
encoding is deterministic, so the stored bytes are the same either way.

Delta arrays (`write_array(..., base=record)`): each chunk stores
zstd(window XOR base window). Equal windows give zero bytes, which are not
stored, so "train routes == rollout routes" costs one metadata object.

Prompt-aligned rows (`write_array(..., heads=...)`, record format 2): a row
of prompt + response tokens is windowed in two segments, so a prompt shared
by a group's samples (their prefill routes) is the same objects in each;
without heads a window mixes the prompt with the sample's own response.
Records are stored zstd-compressed (`ArrayRecord.to_object`); plain-JSON
records, as written before, still read.
"""

from __future__ import annotations

from trajstore.cas.array_read import read_array, read_rows, window_bytes
from trajstore.cas.array_record import ArrayRecord, load_record, record_objects
from trajstore.cas.array_write import ENCODE_CACHE, write_array
from trajstore.cas.chunk_codec import (
    CHUNK_TOKENS_SCALAR,
    CHUNK_TOKENS_TOKENWISE,
    DTYPES,
    ZSTD_LEVEL,
    chunk_tokens_for,
    decode_chunk,
    decode_chunks,
    encode_chunk,
)

__all__ = [
    "CHUNK_TOKENS_SCALAR",
    "CHUNK_TOKENS_TOKENWISE",
    "DTYPES",
    "ENCODE_CACHE",
    "ZSTD_LEVEL",
    "ArrayRecord",
    "chunk_tokens_for",
    "decode_chunk",
    "decode_chunks",
    "encode_chunk",
    "load_record",
    "read_array",
    "read_rows",
    "record_objects",
    "window_bytes",
    "write_array",
]
