"""numpy's BLAS on one thread in the broker process.

Matching (broker/matching.py) multiplies (nodes x prompts) by (prompts x nodes) matrices.
OpenBLAS, which numpy's wheels bundle, splits a product of that size over one thread per
core, and its threads spin-wait for each other: when another thread or process holds one
of the cores (gRPC's threads, the nodes on the same machine, anything else), a product
that takes 3-6 ms alone took 90 ms to 2 s (issue 13, seventh pass: seven 64 x 4,096 x 64
float32 products, p50 / p90 5.8 / 92 ms with OpenBLAS's default of one thread per core on a
2-core machine that was not idle, 3.0 / 6.7 ms on one thread; with one core busy 15 / 741 ms
against 6.5 / 6.6 ms). A broker serves many threads at once, so it takes one BLAS thread.

OpenBLAS reads OPENBLAS_NUM_THREADS only when it is loaded, which is before the broker
knows it is the broker; so this calls its `*openblas_set_num_threads*` on the library the
process has loaded (found in /proc/self/maps; elsewhere, or with another BLAS, nothing
happens).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("graft_fed.broker")

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries this process has loaded (Linux; [] elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            return sorted({line.split(None, 5)[5].strip() for line in fh
                           if line.count(" ") >= 5 and "openblas" in line.rsplit("/", 1)[-1].lower()})
    except OSError:
        return []


def one_blas_thread() -> bool:
    """Set every loaded OpenBLAS to one thread; True when one was found and set."""
    import numpy  # noqa: F401 - loads numpy's BLAS, so that it is there to be found

    done = False
    for path in loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(1))
                done = True
                break
    if not done:
        log.debug("no OpenBLAS found to set to one thread")
    return done
