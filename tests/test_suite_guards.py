"""The suite's own guards: a hung test, or something a test leaves running, ends the run with
the stacks that say where, instead of holding CI until its own limit (which says nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, body: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(body)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
           "--rootdir", str(tmp_path), "-p", "tests.conftest", *args, str(tmp_path)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_a_hung_test_fails_with_its_stack_and_the_run_goes_on(tmp_path):
    done = _pytest(tmp_path, "import time\n\n"
                             "def test_hangs():\n    time.sleep(600)\n\n"
                             "def test_after():\n    pass\n", "-o", "timeout=2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout, done.stdout
    assert "Timeout" in done.stdout and "time.sleep(600)" in done.stdout, done.stdout


def test_a_thread_left_running_ends_the_run_with_its_stack(tmp_path):
    done = _pytest(tmp_path, "import threading, time\n\n"
                             "def never_ends():\n    time.sleep(600)\n\n"
                             "def test_leaves_a_thread():\n"
                             "    threading.Thread(target=never_ends, daemon=False).start()\n",
                   env={"GRAFT_FED_TEST_EXIT_GRACE_S": "2"})
    assert "1 passed" in done.stdout, done.stdout
    assert done.returncode == 1 and "Timeout" in done.stderr and "in never_ends" in done.stderr, done.stderr


#: what a test must not count before and after to find what it leaked: the whole process's
#: threads or descriptors, which other tests' threads and the garbage collector change
#: meanwhile (two CI runs failed so, on 21 descriptors against 22 and on a like count). Count
#: what the test made itself instead: tests/fds.py (descriptors on its own path), its own
#: server's threads, or the Thread objects it started.
PROCESS_WIDE = ("threading.active_count(", 'listdir("/proc/self/fd")', "listdir('/proc/self/fd')", "num_fds(")


def test_no_test_counts_process_wide_threads_or_descriptors():
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name in ("fds.py", "test_suite_guards.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(p in line for p in PROCESS_WIDE):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
