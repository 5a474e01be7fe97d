"""The broker process runs numpy's BLAS on one thread (broker/blas.py)."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json
import numpy as np
from threadpoolctl import threadpool_info
from graft_fed.broker.blas import one_blas_thread

def blas_threads():
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

found = one_blas_thread()
a = np.arange(12, dtype=np.float32).reshape(3, 4)
right = (a @ a.T).tolist() == (a.astype(np.float64) @ a.T.astype(np.float64)).tolist()
print(json.dumps({"found": found, "threads": blas_threads(), "right": right}))
"""


def test_one_blas_thread_sets_numpys_blas_to_one_thread():
    # in a process of its own: the setting lasts for the process's life
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["found"] >= 1  # numpy's wheels bundle an OpenBLAS, which threadpoolctl knows
    assert got["threads"] and all(t == 1 for t in got["threads"])
    assert got["right"]  # products are still right

