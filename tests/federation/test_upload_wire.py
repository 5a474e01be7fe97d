"""A source's upload requests leave as one round's requests encoded once per prompt and
joined (broker/answers.py::_uploads_wire): the same bytes as encoding the sorted list
(_upload_requests), for every node, with groups that already have a bundle left out, with
a receiver gone on to the next round and with matches stored as rows (those take the
sorted list), and with a match set whose prompt ids do not ascend with its columns."""

from __future__ import annotations

import random

from graft_fed.federation.codec import upload_requests_wire
from tests.federation.helpers import broker_config, start_broker
from tests.federation.test_broker_rpc import client, record, summary

NODES = 5


def _same_bytes(broker, names) -> int:
    answers, longest = broker.fed.answers, 0
    for name in names:
        listed = answers._upload_requests(name)
        assert answers._uploads_wire(name, upload_requests_wire) == upload_requests_wire(listed), name
        longest = max(longest, len(listed))
    return longest


def test_upload_requests_joined_are_the_sorted_list_encoded(prompt_file, prompts):
    rng = random.Random(7)
    broker = start_broker(broker_config(prompt_file, balance="none", min_nodes=NODES))
    names = [f"n{i}" for i in range(NODES)]
    nodes = [client(broker, prompts, name) for name in names]
    late = None
    try:
        uploaded = {}
        for c in nodes:
            ks = [rng.choice([0, 0, 1, 1, 1, 2]) for _ in prompts]
            assert c.publish(0, [summary(p, k) for p, k in zip(prompts, ks)])[0] == len(prompts)
            for p in [p for p, k in zip(prompts, ks) if k == 1][:1]:  # a group with a bundle: not asked for
                assert c.upload(record(p, 1, model=c.node_id), 0)[1]
                uploaded[c.node_id] = p.id
        for c in nodes:
            assert c.get_matches(0, 10.0).ready
        assert _same_bytes(broker, names) > 1  # several requests in one answer, in order
        ms = broker.fed.matcher.match_set(0)
        for name in names:  # every group given to a receiver, but the one uploaded
            given = {m.prompt_id for m in ms.rows(source=name)}
            assert broker.fed.answers._upload_requests(name) == sorted((p, 0) for p in given - {uploaded.get(name)})
        assert any(uploaded.get(name) in {m.prompt_id for m in ms.rows(source=name)} for name in names)
        got = nodes[0].get_matches(0, 0.0).upload_requests  # over gRPC: the joined bytes parse
        assert got == broker.fed.answers._upload_requests("n0")
        # a node moves on to round 1 while the others are still at round 0: one round each
        assert nodes[1].publish(1, [summary(p, 0, round=1) for p in prompts[:2]])[0] == 2
        _same_bytes(broker, names)
        # a set whose ids do not ascend with its columns (none is stored so, but one could be
        # read back from an older broker): the sorted list
        ms = broker.fed.matcher.match_set(0)
        with broker.fed.matcher._sets_lock:
            broker.fed.matcher._sets[0] = type(ms)(ms.round, ms.nodes, list(reversed(ms.pids)), ms.receiver,
                                                   len(ms.pids) - 1 - ms.col, ms.source, ms.k)
        assert _same_bytes(broker, names) > 1
        assert broker.fed.answers._wires[0][1] is None  # not joined: sorted
        with broker.fed.matcher._sets_lock:
            broker.fed.matcher._sets[0] = ms
        # a late joiner at round 0, matched on its own: its matches are rows (the sorted list)
        late = client(broker, prompts, "late")
        assert late.publish(0, [summary(p, 0) for p in prompts])[0] == len(prompts)
        assert late.get_matches(0, 5.0).ready
        _same_bytes(broker, names + ["late"])
    finally:
        for c in nodes + ([late] if late else []):
            c.close()
        broker.stop()
