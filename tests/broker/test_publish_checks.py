"""A publish's checks on columns (`Publishing._block_valid`, the fast path every publish of
SummaryColumns takes) accept exactly what the row checks (`_validate_rows`, whose error a
refused publish gets) accept, at every edge of every bound: reward_mean and reward_std against
k/n within their tolerances (population or sample std), NaN and infinities, lengths, mean
log-probs and counts; and on a block as it comes off the wire, with unsigned 32-bit columns."""

import json
import math

import numpy as np
import pytest

from graft_fed.broker.handlers import Federation
from graft_fed.broker.state_memory import InMemoryState
from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.federation.codec import columns_to_pb, parse_publish, summaries_from_columns
from graft_fed.federation.limits import MIN_MEAN_LOGPROB
from graft_fed.federation.messages import SummaryRow
from graft_fed.federation.summaryblock import SummaryBlock
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config


def _fed(tmp_path, n: int) -> tuple[Federation, list[str]]:
    path = tmp_path / f"prompts{n}.jsonl"
    path.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(4)))
    ids = [p.id for p in load_prompts(DataConfig(source=str(path)))]
    return Federation(broker_config(path, n=n), InMemoryState()), ids


def _row(pid: str, n: int, k: int, over: dict | None = None) -> SummaryRow:
    p = k / n
    base = dict(node_id="a", round=3, prompt_id=pid, policy_version=1, n=n, k=k, reward_mean=p,
                reward_std=math.sqrt(p * (1 - p)), lengths=[5] * n, mean_logprobs=[-0.5] * n)
    base.update(over or {})
    return SummaryRow(**base)


def _edges(n: int, k: int) -> list[dict]:
    """Values of one summary at and around each bound."""
    p = k / n
    pop = math.sqrt(p * (1 - p))
    sample = math.sqrt(p * (1 - p) * n / (n - 1)) if n > 1 else 0.0
    out: list[dict] = []
    for d in (0.0, 0.5e-6, -0.5e-6, 1.5e-6, -1.5e-6):
        out.append({"reward_mean": p + d})
        for std in (pop, sample):
            out.append({"reward_std": std + d * max(1.0, std)})
    for bad in (math.nan, math.inf, -math.inf):
        out += [{"reward_mean": bad}, {"reward_std": bad}, {"mean_logprobs": [-0.5] * (n - 1) + [bad]}]
    out += [{"reward_std": -0.0}, {"reward_mean": -0.0},
            {"lengths": [5] * (n - 1) + [0]}, {"lengths": [5] * (n - 1) + [1]},
            {"mean_logprobs": [MIN_MEAN_LOGPROB] * n}, {"mean_logprobs": [MIN_MEAN_LOGPROB - 1e-9] * n},
            {"mean_logprobs": [1e-6] * n}, {"mean_logprobs": [2e-6] * n}, {"mean_logprobs": [-0.0] * n},
            {"lengths": [5] * (n + 1), "mean_logprobs": [-0.5] * (n + 1)}, {"n": n + 1}, {"k": n + 1},
            {"mean_logprobs": [-0.5] * (n + 1)}, {"mean_logprobs": [-0.5] * (n - 1)}, {"lengths": [5] * (n - 1)}]
    return out


@pytest.mark.parametrize("n", [2, 3, 8])
def test_the_column_checks_accept_exactly_what_the_row_checks_accept(tmp_path, n):
    fed, ids = _fed(tmp_path, n)
    publishing = fed.publishing
    seen = {True: 0, False: 0}
    for k in range(n + 1):
        for over in _edges(n, k):
            rows = [_row(ids[0], n, k), _row(ids[1], n, k, over)]
            try:
                publishing._validate_rows("a", 3, rows)
                by_rows = True
            except Exception:  # noqa: BLE001 - InvalidArgument, with the row's words
                by_rows = False
            block = SummaryBlock.from_rows(rows)
            assert publishing._block_valid("a", 3, block) is by_rows, (n, k, over)
            seen[by_rows] += 1
            if len(set(map(len, (rows[1].lengths, rows[1].mean_logprobs)))) == 1 and 0 <= rows[1].k < 2**32 \
                    and rows[1].n < 2**32:
                # the same summaries as a publish's columns, read as the broker reads them
                raw = pb.PublishRequest(node_id="a", round=3, columns=columns_to_pb(rows)).SerializeToString()
                message, on_wire = parse_publish(raw)
                wire = summaries_from_columns(message, raw, on_wire).block
                assert wire.k.dtype == np.dtype("<u4") and wire.lengths.dtype == np.dtype("<u4")
                assert publishing._block_valid("a", 3, wire) is by_rows, ("wire", n, k, over)
    assert seen[True] and seen[False]  # both sides of the bounds were reached
    # the tolerances themselves (both checks read one rule): within 1e-6 accepted, beyond refused
    k = n // 2
    p = k / n
    for std in (math.sqrt(p * (1 - p)), math.sqrt(p * (1 - p) * n / (n - 1))):
        for d, ok in ((0.5e-6, True), (-0.5e-6, True), (1.5e-6, False), (-1.5e-6, False)):
            row = _row(ids[1], n, k, {"reward_std": std + d * max(1.0, std)})
            assert publishing._block_valid("a", 3, SummaryBlock.from_rows([row])) is ok, (n, k, std, d)
    for d, ok in ((0.5e-6, True), (1.5e-6, False)):
        row = _row(ids[1], n, k, {"reward_mean": p + d})
        assert publishing._block_valid("a", 3, SummaryBlock.from_rows([row])) is ok, (n, k, d)


def test_a_quota_warning_is_logged_once_past_80_percent_and_again_only_after_falling_below_70(caplog):
    from graft_fed.broker.ratelimit import QuotaWarnings

    warn = QuotaWarnings("max_node_summaries", "publishes")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "of its quota" in r.getMessage()]

    for held in (0, 79, 80, 95, 100, 75):  # 75: still above the re-arm line
        warn.note("a", held, 100)
    assert said() == ["node 'a' reaches 80 summaries, 80% of its quota of 100 summaries (broker.max_node_summaries): "
                      "past it, its publishes are refused. Retention (broker.keep_rounds) frees them as rounds go by, "
                      "or raise the quota"]
    warn.note("b", 130, 100)  # each node its own; an upper bound past the quota says the quota
    assert "node 'b' reaches 100 summaries, 100% of its quota" in said()[-1]
    warn.note("a", 69, 100)  # retention freed some ...
    warn.note("a", 85, 100)  # ... and it came back
    assert [m.split(" reaches")[0] for m in said()] == ["node 'a'", "node 'b'", "node 'a'"]
    warn.note("c", 10**9, 0)  # no quota: nothing to say
    assert len(said()) == 3
