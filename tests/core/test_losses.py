import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_fed.core.losses import Normalizer, clipped_surrogate, k3_kl


def _one(ratio: float, adv: float, eps_low=0.2, eps_high=0.28):
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    old = torch.zeros(1, 1)
    mask = torch.ones(1, 1)
    out = clipped_surrogate(lp, old, torch.tensor([adv]), mask, Normalizer.of(mask, 1),
                            eps_low=eps_low, eps_high=eps_high)
    out.loss.backward()
    return out, lp.grad.item()


@pytest.mark.parametrize("ratio,adv,objective,grad_flows,low,high", [
    # positive advantage: clipped above at 1 + 0.28
    (1.10, 1.0, 1.10, True, False, False),
    (1.27, 1.0, 1.27, True, False, False),
    (1.40, 1.0, 1.28, False, False, True),
    (0.50, 1.0, 0.50, True, False, False),  # min() keeps the unclipped, smaller value
    # negative advantage: clipped below at 1 - 0.2
    (0.90, -1.0, -0.90, True, False, False),
    (0.70, -1.0, -0.80, False, True, False),
    (1.50, -1.0, -1.50, True, False, False),  # pessimistic branch: no clip for large ratios
])
def test_clip_boundaries_both_signs(ratio, adv, objective, grad_flows, low, high):
    out, grad = _one(ratio, adv)
    assert out.objective.item() == pytest.approx(objective, abs=1e-6)
    assert (grad != 0.0) == grad_flows
    assert bool(out.clipped_low.item()) == low and bool(out.clipped_high.item()) == high


def test_token_mean_hand_computed_with_mask_and_weights():
    # two responses, lengths 2 and 1 (third column masked), ratio 1 everywhere
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    w = torch.tensor([0.5, 1.0])
    out = clipped_surrogate(lp, torch.zeros(2, 3), adv, mask, Normalizer.of(mask, 3), weights=w)
    # J = (0.5 * (2 + 2) + 1.0 * (-1)) / 3 tokens
    assert out.objective.item() == pytest.approx((0.5 * 4 - 1) / 3)
    out.loss.backward()
    # d(-J)/d lp at ratio 1 = -w a / N on admitted tokens, 0 on masked ones
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [1 / 3, 0.0, 0.0]]))


def test_other_aggregations():
    lp = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, 2.0])
    norm = Normalizer.of(mask, 4)
    sm = clipped_surrogate(lp, lp, adv, mask, norm, aggregation="seq-mean-token-mean").objective
    assert sm.item() == pytest.approx((1.0 + 2.0) / 2)
    dr = clipped_surrogate(lp, lp, adv, mask, norm, aggregation="dr-grpo").objective
    assert dr.item() == pytest.approx(((2 * 1.0) / 4 + (4 * 2.0) / 4) / 2)


def test_masked_garbage_does_not_leak():
    lp = torch.tensor([[0.1, 50.0]])
    mask = torch.tensor([[1.0, 0.0]])
    a = clipped_surrogate(lp, torch.zeros(1, 2), torch.tensor([1.0]), mask, Normalizer.of(mask, 2))
    b = clipped_surrogate(torch.tensor([[0.1, -3.0]]), torch.zeros(1, 2), torch.tensor([1.0]), mask,
                          Normalizer.of(mask, 2))
    assert a.objective.item() == b.objective.item()
    assert not a.clipped_high[0, 1]


def test_microbatch_accumulation_equals_full_batch():
    torch.manual_seed(0)
    lp = torch.randn(6, 5, requires_grad=True)
    old = lp.detach() + 0.1 * torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    adv = torch.randn(6)
    norm = Normalizer.of(mask, 5)
    full = clipped_surrogate(lp, old, adv, mask, norm).loss
    (g_full,) = torch.autograd.grad(full, lp)
    parts = sum(clipped_surrogate(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], norm).loss
                for i in range(0, 6, 2))
    (g_parts,) = torch.autograd.grad(parts, lp)
    torch.testing.assert_close(g_full, g_parts)


def test_sequence_ratio_is_length_normalised():
    lp = torch.tensor([[math.log(1.2), math.log(1.2), 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = clipped_surrogate(lp, torch.zeros(1, 3), torch.tensor([1.0]), mask, Normalizer.of(mask, 3), ratio="sequence")
    torch.testing.assert_close(out.ratio[0, :2], torch.tensor([1.2, 1.2]))


def test_k3_kl_zero_at_equal_policies_and_positive_otherwise():
    lp = torch.tensor([[-1.0, -2.0]])
    assert torch.equal(k3_kl(lp, lp), torch.zeros(1, 2))
    assert (k3_kl(lp, lp + 0.3) > 0).all()


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000))
def test_ratio_one_gives_advantage_weighted_token_mean(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.4).float()
    mask[:, 0] = 1.0
    adv = torch.randn(b, generator=g)
    out = clipped_surrogate(lp, lp.clone(), adv, mask, Normalizer.of(mask, t))
    expected = (adv.unsqueeze(-1) * mask).sum() / mask.sum()
    torch.testing.assert_close(out.objective, expected, atol=1e-5, rtol=1e-5)
