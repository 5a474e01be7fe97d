"""A fetch streams the bundle from the SQLite state a chunk at a time: the broker's memory
per fetch is bounded by the chunk size, not the bundle (issue 13)."""

from __future__ import annotations

import gc
import os
import tracemalloc

from graft_fed.broker.handlers import Federation
from graft_fed.broker.servicer import BrokerServicer
from graft_fed.broker.state_sqlite import SqliteState
from graft_fed.federation.bundles import digest_of
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config


class _Context:
    def abort(self, code, message):  # noqa: ANN001, ANN201 - grpc.ServicerContext's shape
        raise AssertionError(f"aborted: {code} {message}")


def test_fetch_holds_one_chunk_not_the_bundle(prompt_file, tmp_path):
    state = SqliteState(tmp_path / "b.db")
    fed = Federation(broker_config(prompt_file, chunk_kib=256), state)
    servicer = BrokerServicer(fed)
    data = os.urandom(16 * 2**20)
    digest = digest_of(data)
    state.put_bundle(digest, data)
    session, _ = fed.join("r", "m", "t", fed.manifest, "share_all", 0)
    fed.grants.grant("r", [digest])
    del data
    gc.collect()
    tracemalloc.start()
    try:
        received, peak_chunk = 0, 0
        for chunk in servicer.FetchBundle(pb.FetchBundleRequest(node_id="r", session_id=session, digest=digest),
                                          _Context()):
            assert chunk.offset == received and chunk.total_size == 16 * 2**20
            received += len(chunk.data)
            peak_chunk = max(peak_chunk, len(chunk.data))
            del chunk
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        state.close()
    assert received == 16 * 2**20 and peak_chunk == 256 * 1024
    assert peak < 4 * 256 * 1024, f"peak {peak} bytes while streaming a 16 MiB bundle in 256 KiB chunks"
