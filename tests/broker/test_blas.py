"""The broker process: numpy's BLAS on one thread (broker/blas.py), malloc arenas capped (server.py)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

CHILD = """
import json
import os
import platform
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


def test_the_malloc_arena_cap_is_set_once_and_leaves_the_environment_alone():
    """broker.malloc_arena_max: mallopt(M_ARENA_MAX) where glibc is there, nothing when the
    operator's MALLOC_ARENA_MAX (applied by glibc itself) is set or the cap is 0."""
    code = ("import json, os; from graft_fed.broker.server import limit_malloc_arenas;"
            "print(json.dumps([limit_malloc_arenas(0), limit_malloc_arenas(2)]))")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 0, plain.stderr
    zero, two = json.loads(plain.stdout.strip().splitlines()[-1])
    assert zero is False
    assert two is (platform.libc_ver()[0] == "glibc")
    env["MALLOC_ARENA_MAX"] = "4"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert theirs.returncode == 0, theirs.stderr
    assert json.loads(theirs.stdout.strip().splitlines()[-1]) == [False, False]
