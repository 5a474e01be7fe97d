"""The broker's C heap (glibc only): its malloc arenas and its thresholds for chunk-sized buffers.

`limit_malloc_arenas`: with hundreds of worker threads glibc opens up to 8 arenas per core,
and each keeps its own peak of freed memory; under 256 nodes x 256 prompts the broker's RSS
grew 16.5 MiB/min with glibc's default and 5.9 with 2 arenas (docs/performance.md, "eighth
pass"). `broker.malloc_arena_max` sets the cap where `graft-fed broker` starts.

`trim_heap`: the housekeeping's malloc_trim(0) every `broker.malloc_trim_s`: glibc keeps
what the broker frees (an answer's bytes, a publish's block) in its heaps for reuse, and
only the free top of a heap goes back to the kernel; malloc_trim also returns the whole free
pages inside them, so RSS follows what the broker holds rather than its past peaks.

`keep_chunk_buffers`:

Every chunk a fetch streams passes through a few buffers of about the chunk's size (the
bytes read from SQLite, the protobuf message, its serialisation, gRPC's copy). glibc serves
an allocation above its mmap threshold (128 KiB at start) with a fresh mmap, and gives the
top of a heap back to the kernel once more than its trim threshold (2 x the mmap threshold)
lies free there, so each of those buffers comes back as new pages the kernel faults in and
zeroes: ~2.3 faults per KiB streamed, which took a 16 MiB fetch from 0.63-0.70x of raw gRPC
to 0.43-0.44x (issue 13, docs/performance.md "fifth pass"). Before uploads were streamed,
the 16 MiB an upload joined raised both thresholds as a side effect (glibc raises them to
the size of a freed mmap'd block, up to 32 MiB); an upload stored a chunk at a time no
longer does. `keep_chunk_buffers` sets them outright: buffers of a few chunks come from the
heap and free memory of up to 16 chunks stays at a heap's top for the next one.
"""

from __future__ import annotations

import logging
import os
import platform

log = logging.getLogger("graft_fed.broker")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: glibc's own ceiling for its dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
MMAP_THRESHOLD_MAX = 32 * 2**20

_applied = 0  # the mmap threshold set in this process so far (only ever raised)


def _libc(name: str):  # noqa: ANN202 - a glibc function, or None off glibc
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        import ctypes

        return getattr(ctypes.CDLL(None), name)  # CDLL: the GIL is released during the call
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """malloc_trim(0): give the C heap's free pages back to the kernel. True when some memory
    was released; False when none was, or off glibc."""
    malloc_trim = _libc("malloc_trim")
    return malloc_trim is not None and malloc_trim(0) == 1


def limit_malloc_arenas(count: int) -> bool:
    """Cap this process's malloc arenas at `count` (before the worker threads start); nothing
    when `count` is 0, when MALLOC_ARENA_MAX is set in the environment (glibc applied it) or
    off glibc. True when the cap was set."""
    if count <= 0 or "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = _libc("mallopt")
    return mallopt is not None and mallopt(M_ARENA_MAX, count) == 1


def keep_chunk_buffers(chunk: int) -> bool:
    """Serve buffers of up to 4 chunks from the heap and keep up to 16 chunks free at a
    heap's top. Returns whether the thresholds are (now) set; False where the C library is
    not glibc, which changes nothing."""
    global _applied
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mmap_threshold = min(max(4 * chunk, 128 * 1024), MMAP_THRESHOLD_MAX)
    if mmap_threshold <= _applied:
        return True
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, 4 * mmap_threshold) == 1
    if ok:
        _applied = mmap_threshold
    else:
        log.warning("could not set the C heap's thresholds (mallopt): chunk-sized buffers may be mapped afresh")
    return ok
