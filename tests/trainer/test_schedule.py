from hypothesis import given, settings
from hypothesis import strategies as st

from graft_fed.data.prompts import Prompt
from graft_fed.trainer.schedule import PromptSchedule


def prompts(n):
    return [Prompt.make("t", f"problem {i}", str(i)) for i in range(n)]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(0, 5))
def test_batches_never_repeat_a_prompt_and_depend_only_on_seed_and_index(n, b, seed):
    if n < b:
        return
    ps = prompts(n)
    a = PromptSchedule(ps, b, seed)
    other = PromptSchedule(list(reversed(ps)), b, seed)  # row order does not matter
    for r in range(7):
        batch = a.next_batch()
        assert len(batch) == b and len({p.id for p in batch}) == b
        assert [p.id for p in batch] == [p.id for p in other.batch(r)]


def test_each_epoch_is_a_permutation_slice():
    s = PromptSchedule(prompts(10), 3, 0)
    seen = [p.id for r in range(3) for p in s.batch(r)]
    assert len(set(seen)) == 9
