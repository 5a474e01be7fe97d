"""The broker process runs numpy's BLAS on one thread (broker/blas.py)."""

from __future__ import annotations

import ctypes

import numpy as np

from graft_fed.broker.blas import loaded_openblas, one_blas_thread


def test_one_blas_thread_sets_the_loaded_openblas_to_one_thread():
    found = one_blas_thread()
    getters = []
    for path in loaded_openblas():
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                     "openblas_get_num_threads64_", "openblas_get_num_threads"):
            if hasattr(lib, name):
                getters.append(getattr(lib, name))
                break
    assert found == bool(getters)  # set wherever numpy's BLAS is an OpenBLAS it can reach
    assert all(get() == 1 for get in getters)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert (a @ a.T).tolist() == (a.astype(np.float64) @ a.T.astype(np.float64)).tolist()  # products still right
