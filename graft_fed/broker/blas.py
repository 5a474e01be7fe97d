"""numpy's BLAS on one thread in the broker process.

Matching (broker/matching.py) multiplies (nodes x prompts) by (prompts x nodes) matrices.
OpenBLAS, which numpy's wheels bundle, splits a product of that size over one thread per
core, and its threads spin-wait for each other: when another thread or process holds one
of the cores (gRPC's threads, the nodes on the same machine, anything else), a product
that takes 3-6 ms alone took 90 ms to 2 s (issue 13, seventh pass: seven 64 x 4,096 x 64
float32 products, p50 / p90 5.8 / 92 ms with OpenBLAS's default of one thread per core on a
2-core machine that was not idle, 3.0 / 6.7 ms on one thread; with one core busy 15 / 741 ms
against 6.5 / 6.6 ms). A broker serves many threads at once, so it takes one BLAS thread.

The BLAS reads its thread variables (OPENBLAS_NUM_THREADS, ...) only when it is loaded,
which is before the broker knows it is the broker; threadpoolctl sets the loaded library's
thread count through its own API, for OpenBLAS, MKL and BLIS alike.
"""

from __future__ import annotations

import logging

log = logging.getLogger("graft_fed.broker")


def one_blas_thread() -> int:
    """Set every BLAS this process has loaded (numpy's, loaded here) to one thread; returns
    how many libraries were set."""
    import numpy  # noqa: F401 - loads numpy's BLAS, so that there is one to set
    from threadpoolctl import threadpool_info, threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # not as a context: for the process's life
    found = sum(1 for lib in threadpool_info() if lib.get("user_api") == "blas")
    if not found:
        log.debug("no BLAS library found to set to one thread")
    return found
