"""A receiver's screening of peer groups and the optimiser's finite-update guard
(graft_fed/core/screening.py; issue 12, class 3: poisoning a receiver)."""

import dataclasses
import math

import pytest
import torch

from graft_fed.core.exchange import compatibility, gate_weights
from graft_fed.core.records import GroupRecord, RecordError
from graft_fed.core.screening import (ScreeningError, ScreenSettings, check_advantages, check_source_logprobs,
                                      expected_advantages, peer_groups_of, screen_record, update_is_finite)


def honest(rewards=(1.0, 0.0, 0.0, 1.0), scale="group", std="sample"):
    adv = expected_advantages(rewards, scale, std)
    n = len(rewards)
    return GroupRecord(prompt_id="p", step=3, model_id="src", tokenizer_id="tok", problem="1+1?", answer="2",
                       rewards=tuple(rewards), advantages=adv, texts=("a",) * n, finish_reasons=("stop",) * n,
                       lengths=(3,) * n, mean_logprobs=(-0.7,) * n)


@pytest.mark.parametrize("scale,std", [("group", "sample"), ("group", "population"), ("none", "sample")])
def test_an_honest_group_passes_and_its_advantages_are_recomputed_bit_for_bit(scale, std):
    rec = honest(scale=scale, std=std)
    s = ScreenSettings(scale=scale, std=std)
    assert screen_record(rec, s) == rec.advantages
    # the canonical JSON a bundle carries (float64 repr of float32 values) round-trips too
    assert check_advantages(rec.rewards, [float(repr(a)) for a in rec.advantages], s) == rec.advantages


@pytest.mark.parametrize("claimed", [
    (1e300, -1e300, -1e300, 1e300),  # finite in float64, inf in float32: the loss becomes NaN
    (3.0, -3.0, -3.0, 3.0),  # the right signs, 3.5x too large: a louder update for the source's text
    (0.9, -0.8, -0.8, 0.9),  # the right signs and magnitude class, but not Eq. 1
    (float("nan"),) * 4,
])
def test_claimed_advantages_that_are_not_eq1_of_the_rewards_are_refused(claimed):
    rec = honest()
    with pytest.raises(ScreeningError) as info:
        check_advantages(rec.rewards, claimed)
    assert info.value.reason == "advantages"
    # the refusal uses the rewards the receiver re-verified, not the ones claimed
    with pytest.raises(ScreeningError):
        check_advantages((1.0, 1.0, 0.0, 0.0), rec.advantages)


def test_a_record_with_absurd_claims_is_refused_before_any_model_sees_it():
    rec = honest()
    for bad in (dict(advantages=(1e300, -1e300, -1e300, 1e300)), dict(mean_logprobs=(-1e6,) * 4),
                dict(mean_logprobs=(-25.0,) * 4), dict(mean_logprobs=(0.5,) * 4)):
        with pytest.raises(RecordError):  # ScreeningError is a RecordError
            screen_record(dataclasses.replace(rec, **bad))
    with pytest.raises(ScreeningError, match="outside"):
        check_source_logprobs([-0.5, -21.0])
    check_source_logprobs([-0.5, -19.0, 0.0])


def test_the_gate_cannot_be_opened_by_a_claimed_log_prob_that_screening_lets_through():
    # what the attack wanted: s = exp(lbar_R - lbar_S) with lbar_S = -1e6 admits everything
    lbar_r = torch.tensor([-9.0, -12.0])
    assert bool((gate_weights(compatibility(lbar_r, torch.tensor([-1e6, -1e6]))) == 1).all())
    # within the screened range the receiver's own likelihood still decides who is dropped
    w = gate_weights(compatibility(lbar_r, torch.tensor([-0.5, -0.5])))
    assert w.tolist() == [0.0, 0.0]


def _policy_step(adv: torch.Tensor, guard: bool) -> tuple[torch.nn.Linear, bool]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4)
    logp = torch.log_softmax(model(x), -1)[:, 0]
    loss = -(adv.float() * logp).mean()
    loss.backward()
    ok = update_is_finite(loss, model.parameters())
    if ok or not guard:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    opt.zero_grad(set_to_none=True)
    return model, ok


def test_a_receiver_fed_a_poisoned_group_keeps_finite_weights_and_names_the_source():
    poisoned = torch.tensor([1e300, -1e300, -1e300, 1e300], dtype=torch.float64)  # inf in float32
    broken, _ = _policy_step(poisoned, guard=False)
    assert not all(bool(torch.isfinite(p).all()) for p in broken.parameters())  # what happened before
    model, ok = _policy_step(poisoned, guard=True)
    assert not ok and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    fine, ok = _policy_step(torch.tensor(expected_advantages((1.0, 0.0, 0.0, 1.0))), guard=True)
    assert ok and all(bool(torch.isfinite(p).all()) for p in fine.parameters())

    class G:
        def __init__(self, source, pid):
            self.source, self.prompt = source, type("P", (), {"id": pid})()
    assert peer_groups_of([G("self", "a"), G("evil", "b"), G("evil", "b"), G("", "c"), G("other", "d")]) == [
        ("evil", "b"), ("other", "d")]


def test_update_is_finite_checks_the_loss_and_every_gradient():
    p = torch.nn.Parameter(torch.ones(3))
    assert update_is_finite(torch.tensor(1.0), [p])  # no gradient yet
    p.grad = torch.tensor([0.0, math.inf, 0.0])
    assert not update_is_finite(torch.tensor(1.0), [p])
    p.grad = torch.zeros(3)
    assert not update_is_finite(torch.tensor(float("nan")), [p])
    assert not update_is_finite(float("inf"), [p])
    assert update_is_finite(0.5, [p])


def test_a_response_longer_than_the_receiver_retokenises_is_refused():
    rec = dataclasses.replace(honest(), texts=("a" * 300_000, "b", "c", "d"))
    with pytest.raises(ScreeningError) as info:
        screen_record(rec)
    assert info.value.reason == "too_long"
    assert screen_record(rec, ScreenSettings(max_text_chars=10**6)) == rec.advantages
