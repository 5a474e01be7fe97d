"""Square matrices over the nodes the broker has seen (rows: source, columns: receiver), for
what it counts per (source, receiver) pair: the groups matched (broker/exchange.py) and the
receivers' compatibility reports (broker/compat.py).

A node is one row and one column, at the position it was first seen in. The matrices'
capacity doubles as nodes join; numpy's zeroed pages cost nothing until written, so a
matrix costs its item size per pair that has been written, at most (item size) x capacity^2
(8 bytes a cell: 0.5 MiB at 256 nodes, 8 MiB at 1,000). A pair of Python strings keyed in a
dict costs about 128 bytes, and a scan of N^2 such pairs per call was what issue 13 measured.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


class PairGrid:
    """Node positions and the matrices over them; not thread-safe (its owner locks)."""

    def __init__(self, dtypes: dict[str, type]) -> None:
        self._pos: dict[str, int] = {}
        self._names: list[str] = []
        self.m: dict[str, np.ndarray] = {key: np.zeros((0, 0), dtype=dt) for key, dt in dtypes.items()}

    @property
    def names(self) -> list[str]:
        """The nodes in position order (the list itself: do not change it)."""
        return self._names

    def __len__(self) -> int:
        return len(self._names)

    def positions(self, names: Sequence[str]) -> np.ndarray:
        """Each name's position, adding the names not seen yet (the matrices grow to fit)."""
        for name in names:
            if name not in self._pos:
                self._pos[name] = len(self._names)
                self._names.append(name)
        n = len(self._names)
        cap = next(iter(self.m.values())).shape[0]
        if n > cap:
            new = max(16, cap)
            while new < n:
                new *= 2
            for key, old in self.m.items():
                grown = np.zeros((new, new), dtype=old.dtype)
                grown[:cap, :cap] = old
                self.m[key] = grown
        return np.fromiter((self._pos[x] for x in names), dtype=np.int64, count=len(names))

    def known(self, names: Iterable[str]) -> np.ndarray:
        """Each name's position, -1 for a name not seen (nothing is added)."""
        names = list(names)
        return np.fromiter((self._pos.get(x, -1) for x in names), dtype=np.int64, count=len(names))

    def used(self, key: str) -> np.ndarray:
        """The matrix `key` over the nodes seen (a view, not a copy)."""
        n = len(self._names)
        return self.m[key][:n, :n]
