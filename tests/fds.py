"""Which of this process's descriptors are open on a path: how a test checks that nothing it
opened stays open. A count of all the process's descriptors would not do: other tests'
threads and the garbage collector open and close descriptors of their own meanwhile."""

from __future__ import annotations

import os
from pathlib import Path


def open_under(path: str | Path) -> list[str]:
    """The targets of this process's descriptors that are `path` or lie under it, sorted."""
    root = str(path)
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing
            continue
        if target == root or target.startswith(root + os.sep):
            found.append(target)
    return sorted(found)
