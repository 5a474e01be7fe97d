"""Keyed sampling (rollout.seeding: prompt): a response's tokens depend on its key alone,
so sharding prompts across processes or rollout batches cannot change what is sampled."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from graft_fed.modeling import pack, response_forward
from graft_fed.rollout.base import SamplingParams
from graft_fed.rollout.hf import HFRollout, inverse_cdf_sample, keyed_uniforms, stream_seed


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def test_keyed_samples_do_not_depend_on_batching_or_neighbours(tiny_llama):
    model, tok = _load(tiny_llama)
    sp = SamplingParams(n=3, temperature=0.9, top_k=20, max_new_tokens=10)
    prompts = ["Q: 1+2=?\nA: ", "Q: what is 12 + 345?\nA: ", "Q: x\nA: "]
    seeds = [101, 202, 303]
    whole = HFRollout(model, tok, batch_size=16, seed=0).generate(prompts, sp, seeds=seeds)
    # batch_size 2 splits groups across rollout batches; the engine seed is irrelevant
    split = HFRollout(model, tok, batch_size=2, seed=99).generate(prompts, sp, seeds=seeds)
    alone = [HFRollout(model, tok, batch_size=1, seed=5).generate([p], sp, seeds=[s])[0]
             for p, s in zip(prompts, seeds)]
    ids = [[c.token_ids for c in g] for g in whole]
    assert ids == [[c.token_ids for c in g] for g in split] == [[c.token_ids for c in g] for g in alone]
    assert len({tuple(t) for g in ids for t in g}) > 3  # distinct streams, not one sample repeated
    other = HFRollout(model, tok, batch_size=16).generate(prompts, sp, seeds=[7, 8, 9])
    assert [[c.token_ids for c in g] for g in other] != ids
    # the recorded log-probs are those of the distribution sampled from (as in stream mode)
    flat = [c for g in whole for c in g]
    batch = pack([c.prompt_token_ids for c in flat], [c.token_ids for c in flat], tok.pad_token_id)
    with torch.no_grad():
        full = response_forward(model, batch, temperature=0.9).logprobs
    for i, c in enumerate(flat):
        # top_k renormalises: the recorded log-prob is >= the full-vocabulary one
        assert all(r >= f - 1e-4 for r, f in zip(c.logprobs, full[i, :len(c.token_ids)].tolist()))


def test_inverse_cdf_sampler_draws_the_distribution_and_never_a_masked_token():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    u = keyed_uniforms(stream_seed(1, 2, 3), 40_000)
    draws = inverse_cdf_sample(probs.expand(len(u), -1), u)
    freq = torch.bincount(draws, minlength=len(probs)).double() / len(u)
    sigma = (probs.double() * (1 - probs.double()) / len(u)).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-12).all(), freq
    exact = torch.tensor([0.5, 0.25, 0.25, 0.0])  # dyadic: the cumulative sums are exact
    edges = torch.tensor([0.0, 0.5, 0.75, 1 - 2**-53], dtype=torch.float64)
    got = inverse_cdf_sample(exact.expand(len(edges), -1), edges).tolist()
    assert got == [0, 1, 2, 2]  # a boundary goes to the next token; never the masked last one
    near_one = inverse_cdf_sample(probs.expand(3, -1), torch.tensor([0.99, 1 - 1e-12, 1 - 2**-53]))
    assert near_one.tolist() == [4, 4, 4]
    assert stream_seed(1, 2, 3) == stream_seed(1, 2, 3) != stream_seed(1, 2, 4)
