"""The broker writes MatchResponse.offers and .upload_requests itself (federation/codec.py):
the bytes must parse to exactly the message protobuf would have built."""

from __future__ import annotations

import random

from graft_fed.federation.codec import match_result_from_pb, match_result_to_pb, match_result_to_wire
from graft_fed.federation.messages import MatchResult, Offer
from graft_fed.proto import broker_pb2 as pb


def test_hand_written_answer_parses_to_the_protobuf_message():
    rng = random.Random(0)
    offers = [Offer(prompt_id=f"embedded:{i}" + "x" * rng.choice([0, 130, 20000]),
                    source_node=rng.choice(["", "a", "ü-node", "n" * 300]), source_model=rng.choice(["", "m", "é" * 90]),
                    source_round=rng.choice([0, 1, 127, 128, 2**40, 2**64 - 1]), k=rng.choice([0, 1, 7, 300]),
                    n=rng.choice([0, 8, 2**32 - 1]), digest=rng.choice(["", "ab" * 32]))
              for i in range(300)]
    uploads = [(rng.choice(["", "p", "q" * 200]), rng.choice([0, 5, 2**63])) for _ in range(50)]
    for ready, cands in ((True, 0), (True, 2**32 - 1), (False, 3)):
        res = MatchResult(ready=ready, offers=offers, upload_requests=uploads, candidates=cands, solved_by_peers=7)
        wire = match_result_to_wire(res)
        assert pb.MatchResponse.FromString(wire) == match_result_to_pb(res)
        assert match_result_from_pb(pb.MatchResponse.FromString(wire)) == res
    empty = MatchResult(ready=False, offers=[], upload_requests=[])
    assert pb.MatchResponse.FromString(match_result_to_wire(empty)) == match_result_to_pb(empty)


def test_offer_encoder_writes_what_offers_wire_writes():
    import numpy as np

    from graft_fed.federation.codec import OfferEncoder, offers_wire

    rng = random.Random(1)
    pids = [f"embedded:{i}" + "x" * rng.choice([0, 3, 130, 20000]) for i in range(40)] + [""]
    nodes = ["", "a", "ü-node", "n" * 300, "b"]
    models = ["m", "", "é" * 90, "m2", "m3"]
    for rnd, n in ((0, 8), (1, 0), (2**40, 300)):
        enc = OfferEncoder(pids, nodes, models, rnd, n)
        count = 500
        col = np.array([rng.randrange(len(pids)) for _ in range(count)], dtype=np.int32)
        src = np.array([rng.randrange(len(nodes)) for _ in range(count)], dtype=np.int32)
        k = np.array([rng.choice([0, 1, 7, 127, 128, 300]) for _ in range(count)], dtype=np.int32)
        for digests in (None, [rng.choice(["", "ab" * 32]) for _ in range(count)]):
            tuples = [(pids[c], nodes[s], models[s], rnd, kk, n, digests[i] if digests else "")
                      for i, (c, s, kk) in enumerate(zip(col.tolist(), src.tolist(), k.tolist()))]
            assert enc.encode(col, src, k, digests) == offers_wire(tuples)
            for i in range(0, count, 37):  # runs of offers (one receiver's), each alone
                assert enc.encode(col[i:i + 5], src[i:i + 5], k[i:i + 5],
                                  digests[i:i + 5] if digests else None) == offers_wire(tuples[i:i + 5])
    assert OfferEncoder(pids, nodes, models, 1, 8).encode(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32),
                                                          np.zeros(0, dtype=np.int32)) == b""
