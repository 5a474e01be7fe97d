"""The broker's C heap (glibc only): its malloc arenas and its thresholds for chunk-sized buffers.

`limit_malloc_arenas`: with hundreds of worker threads glibc opens up to 8 arenas per core,
and each keeps its own peak of freed memory; under 256 nodes x 256 prompts the broker's RSS
grew 16.5 MiB/min with glibc's default and 5.9 with 2 arenas (docs/performance.md, "eighth
pass"). `broker.malloc_arena_max` sets the cap where `graft-fed broker` starts.

`without_tcache`: the environment to run `graft-fed broker` again in, with glibc's per-thread
caches of freed blocks (tcache) off. With ~300 worker threads, each keeps up to 7 freed
blocks of every small size for itself, and freed memory spreads over what every thread
and both arenas keep; the heap's pages took about half an hour to settle. With the caches
off and one arena, every thread reuses the same free lists: under 256 nodes x 256 prompts
the broker's RSS after the warm-up rose 0.26 +- 1.24 MiB/min at about 187 MiB, against
2.2-3.3 MiB/min at about 235 MiB (docs/performance.md, "forty-third pass"). glibc reads the
setting only from GLIBC_TUNABLES when the process starts (no mallopt sets it), so the
command re-executes itself once, in the same process (same pid), with it added.

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

`decline_protobuf_trims`: protobuf's upb runtime for Python (up to 7.36 at least) calls
malloc_trim(0) on every 10,000th block its message arenas free, from whichever thread frees
it. In the broker that is every 10-25 s under 256 nodes x 256 prompts: each call hands 15-25
MiB of free pages inside the heap back to the kernel (hundreds of madvise calls, the heap's
lock held) and the next round faults them in again, so RSS saws up and down by that much
(perf: the madvise calls' stack ends in upb_trim_allocfunc; issue 13, docs/performance.md,
"forty-fourth pass"). upstream protobuf has since compiled the call out ("find out whether
this is still needed"). `broker.protobuf_malloc_trim: false` (the default) points the
extension's own entry for malloc_trim (its GOT slot, found from the ELF file's relocations)
at the C library's abs(), which returns at once (upb ignores the result); every other
caller, `broker.malloc_trim_s` included, still reaches glibc's malloc_trim.

`memory_usage`: where the process's memory is, for /metrics (`graft_fed_broker_memory_bytes`)
and the load bench: resident anonymous and file pages (/proc), the C heap's bytes in use,
free and mapped whole (glibc's mallinfo2), what SQLite holds (sqlite3_memory_used), and
Python's object allocator. A growing RSS can so be told apart as live C allocations, freed
memory the heap keeps, SQLite's caches or Python objects.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct
import sys

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
        return getattr(ctypes.CDLL(None), name)  # CDLL: the GIL is released during the call
    except (OSError, AttributeError):
        return None


#: ELF relocation types that fill a GOT slot with a symbol's address (elf.h), per machine
_GOT_RELOCATIONS = {62: (6, 7),        # x86-64: R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
                    183: (1025, 1026)}  # AArch64: R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT


def got_slots(path: str, symbol: str) -> list[int]:
    """Offsets (from the load address) of the GOT slots through which the 64-bit
    little-endian ELF shared object at `path` calls `symbol`: the r_offset of each
    GLOB_DAT or JUMP_SLOT relocation against it. Empty when it does not import `symbol`,
    or for another kind of file or machine."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # ELFCLASS64, ELFDATA2LSB
        return []
    machine, = struct.unpack_from("<H", data, 18)
    kinds = _GOT_RELOCATIONS.get(machine)
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    if kinds is None or not shoff or shentsize < 64:
        return []
    # (type, offset, size, link, entsize) of each section (Elf64_Shdr)
    sections = [struct.unpack_from("<4xI16xQQI4x8xQ", data, shoff + i * shentsize) for i in range(shnum)]
    slots = []
    for kind, offset, size, link, entsize in sections:
        if kind != 4 or entsize != 24 or link >= shnum:  # SHT_RELA against a symbol table
            continue
        _, symoff, _, strtab, symentsize = sections[link]
        if symentsize != 24 or strtab >= shnum:
            continue
        stroff = sections[strtab][1]
        for at in range(offset, offset + size - 23, 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, at)
            if r_info & 0xFFFFFFFF not in kinds:
                continue
            name_at, = struct.unpack_from("<I", data, symoff + (r_info >> 32) * 24)
            end = data.find(b"\0", stroff + name_at)
            if data[stroff + name_at:end].split(b"@")[0] == symbol.encode():
                slots.append(r_offset)
    return slots


def _load_bias(path: str) -> int | None:
    """Where the loaded shared object `path` is mapped (its link map's l_addr); None when
    it is not loaded in this process."""
    dlinfo = _libc("dlinfo")
    if dlinfo is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    link_map = ctypes.c_void_p()
    rtld_di_linkmap = 2
    if dlinfo(ctypes.c_void_p(lib._handle), rtld_di_linkmap, ctypes.byref(link_map)) != 0 or not link_map.value:
        return None
    return ctypes.c_size_t.from_address(link_map.value).value  # struct link_map's first field, l_addr


def _writable(address: int) -> bool | None:
    """Whether the page holding `address` is mapped writable (/proc/self/maps); None when
    no mapping holds it."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms[1] == "w"
    return None


def _write_pointer(address: int, value: int) -> bool:
    """Store `value` at `address`, a GOT slot: made writable for the store if full RELRO
    left it read-only, and read-only again after."""
    writable = _writable(address)
    if writable is None:
        return False
    size = os.sysconf("SC_PAGE_SIZE")
    page = ctypes.c_void_p(address & ~(size - 1))
    mprotect = _libc("mprotect")
    prot_read, prot_write = 1, 2
    if not writable and (mprotect is None or mprotect(page, size, prot_read | prot_write) != 0):
        return False
    ctypes.c_void_p.from_address(address).value = value
    if not writable:
        mprotect(page, size, prot_read)
    return True


def decline_protobuf_trims() -> str:
    """Make protobuf's upb extension call abs() where it calls malloc_trim (above). Returns
    what was done, for the broker's log: "declined", "nothing to decline" (this protobuf
    does not call it), or why it could not be done (then nothing was changed)."""
    try:
        from google._upb import _message
    except ImportError:
        return "nothing to decline (protobuf's upb extension is not in use)"
    path = os.path.realpath(_message.__file__)
    abs_fn = _libc("abs")
    if abs_fn is None:
        return "not declined (not glibc)"
    try:
        slots = got_slots(path, "malloc_trim")
    except (OSError, struct.error) as exc:
        return f"not declined ({path} unreadable: {exc})"
    if not slots:
        return "nothing to decline (this protobuf does not call malloc_trim)"
    bias = _load_bias(path)
    if bias is None:
        return "not declined (the extension's load address is unknown)"
    target = ctypes.cast(abs_fn, ctypes.c_void_p).value
    done = [_write_pointer(bias + slot, target) for slot in slots]
    if all(done):
        return "declined"
    return "partly declined (a GOT slot is not mapped as expected)" if any(done) else \
        "not declined (its GOT slot is not mapped as expected)"


def trim_heap() -> bool:
    """malloc_trim(0): give the C heap's free pages back to the kernel. True when some memory
    was released; False when none was, or off glibc."""
    malloc_trim = _libc("malloc_trim")
    return malloc_trim is not None and malloc_trim(0) == 1


#: the glibc tunable that turns the per-thread caches off
TCACHE_OFF = "glibc.malloc.tcache_count=0"


def without_tcache(environ: dict[str, str] | os._Environ) -> dict[str, str] | None:
    """The environment `environ` with glibc's per-thread caches turned off (GLIBC_TUNABLES),
    for the command to re-execute itself in; None where nothing is to change: off glibc, or
    GLIBC_TUNABLES already says what tcache_count is (the operator's choice, or this process
    is the re-executed one)."""
    if _libc("mallopt") is None:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count=" in tunables:
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{TCACHE_OFF}" if tunables else TCACHE_OFF
    return env


def tcache_off(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this process started with glibc's per-thread caches off."""
    return _libc("mallopt") is not None and TCACHE_OFF in environ.get("GLIBC_TUNABLES", "").split(":")


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


class _Mallinfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_stats() -> dict[str, int]:
    """glibc's heap over all its arenas (mallinfo2, glibc >= 2.33), in bytes: `heap` (what its
    heaps hold from the kernel), `in_use` (handed out by malloc), `free` (free inside the
    heaps), `mmapped` (blocks mapped whole). Empty off glibc, before 2.33, or where another
    malloc is preloaded (glibc's heap then serves nothing)."""
    mallinfo2 = _libc("mallinfo2")
    if mallinfo2 is None or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return {}
    mallinfo2.restype, mallinfo2.argtypes = _Mallinfo2, []
    info = mallinfo2()
    return {"heap": int(info.arena), "in_use": int(info.uordblks), "free": int(info.fordblks),
            "mmapped": int(info.hblkhd)}


def _sqlite_memory_used() -> int | None:
    try:
        import _sqlite3

        fn = ctypes.CDLL(_sqlite3.__file__).sqlite3_memory_used  # the library the sqlite3 module uses
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int64, []
    return int(fn())


_PROC_STATUS = {"RssAnon": "resident_anon", "RssFile": "resident_file", "RssShmem": "resident_shmem",
                "Threads": "threads"}  # /proc/PID/status's fields, and their names here


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _PROC_STATUS:
                    parts = rest.split()
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)  # kB, or a count
    except (OSError, ValueError, IndexError):
        pass
    return out


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """A process's resident memory (`resident_anon`, `resident_file`, `resident_shmem`, bytes)
    and `threads` (a count), where Linux's /proc tells them; {} elsewhere or once it exited."""
    return {_PROC_STATUS[k]: v for k, v in _proc_status(pid).items()}


def memory_usage() -> dict[str, int]:
    """This process's memory by where it is, in bytes (threads: a count). Keys present only
    where the platform tells them: `resident_anon`, `resident_file`, `resident_shmem` and
    `threads` (Linux /proc); `malloc_in_use`, `malloc_free` and `malloc_mmapped` (glibc >=
    2.33, unless another malloc is preloaded: bytes handed out from its heaps, free in them,
    and in blocks mapped whole); `sqlite` (every connection's caches and statements); and
    `python_blocks` (objects Python's allocator holds, a count)."""
    out = process_memory()
    out.update((f"malloc_{k}", v) for k, v in malloc_stats().items() if k != "heap")
    sqlite = _sqlite_memory_used()
    if sqlite is not None:
        out["sqlite"] = sqlite
    out["python_blocks"] = sys.getallocatedblocks()
    return out
