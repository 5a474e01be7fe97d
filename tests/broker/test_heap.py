"""broker/heap.py: the C heap's thresholds for chunk-sized buffers."""

import platform

from graft_fed.broker.heap import keep_chunk_buffers


def test_thresholds_are_set_on_glibc_and_left_alone_elsewhere():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_chunk_buffers(1 << 20) is glibc
    assert keep_chunk_buffers(1 << 18) is glibc  # a smaller chunk keeps the higher threshold
    assert keep_chunk_buffers(1 << 30) is glibc  # capped at glibc's own ceiling
