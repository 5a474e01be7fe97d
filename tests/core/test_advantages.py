import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_fed.core.advantages import group_advantages, successes


def test_hand_computed_sample_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    # mean 0.25, sample std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    adv = group_advantages(r)
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (0.5 + 1e-6)
    torch.testing.assert_close(adv, expected)


def test_population_std_and_no_scaling():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    pop = math.sqrt(0.75 / 4)
    torch.testing.assert_close(group_advantages(r, std="population"),
                               torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (pop + 1e-6))
    torch.testing.assert_close(group_advantages(r, scale="none"), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_zero_variance_groups_get_exact_zeros():
    r = torch.tensor([[0.0] * 8, [1.0] * 8, [0.3] * 8])
    assert torch.equal(group_advantages(r), torch.zeros(3, 8))
    assert torch.equal(group_advantages(torch.tensor([[1.0]])), torch.zeros(1, 1))


def test_successes_on_binary_outcome():
    assert successes(torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])).tolist() == [2, 0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=8, max_size=8), min_size=1, max_size=6))
def test_advantages_sum_to_zero_per_group(rows):
    adv = group_advantages(torch.tensor(rows))
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(len(rows)), atol=1e-4, rtol=0)
