import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from graft_fed.core.advantages import group_advantages
from graft_fed.core.records import GroupRecord
from graft_fed.errors import ConfigError
from graft_fed.modeling import pack, response_forward
from graft_fed.rollout.base import SamplingParams
from graft_fed.rollout.hf import HFRollout
from graft_fed.store import TrajectoryStore
from graft_fed.graft import step as graft_step
from graft_fed.graft.receive import receive
from graft_fed.graft.step import receiver_of
from graft_fed.graft.stored import StoredPeers
from graft_fed.trainer.grpo import GRPOTrainer
from tests.plugins import odd_char_sum
from tests.trainer.test_grpo import make_cfg


def _source_record(source_dir, prompt, problem_text, n=6, seed=0, step=0):
    """Sample a group from the source model and turn it into a record the way a peer would."""
    tok = AutoTokenizer.from_pretrained(source_dir)
    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    engine = HFRollout(model, tok, seed=seed)
    comps = engine.generate([problem_text], SamplingParams(n=n, max_new_tokens=8))[0]
    rewards = [odd_char_sum(c.text, prompt.answer) for c in comps]
    adv = group_advantages(torch.tensor([rewards]))[0].tolist()
    rec = GroupRecord(prompt_id=prompt.id, step=step, model_id="peer", tokenizer_id="t", problem=prompt.problem,
                      answer=prompt.answer, rewards=tuple(rewards), advantages=tuple(adv),
                      texts=tuple(c.text for c in comps), finish_reasons=tuple(c.finish_reason for c in comps),
                      lengths=tuple(len(c.token_ids) for c in comps),
                      mean_logprobs=tuple(c.mean_logprob for c in comps))
    return rec, comps, model, tok


def _receiver(tiny, prompt_file, tmp_path, **over):
    cfg = make_cfg(tiny, prompt_file, tmp_path / "recv", **over)
    tr = GRPOTrainer(cfg, quiet=True)
    data = tr.collect()
    for g in data.groups:  # make every own group all-fail so each one can be replaced
        g.rewards = torch.zeros(g.n)
        g.advantages = torch.zeros(g.n)
    return tr, data.groups


def _informative_record(tiny_gpt2, tr, group, seed=0):
    for s in range(seed, seed + 50):
        rec, comps, model, tok = _source_record(tiny_gpt2, group.prompt, tr.render(group.prompt.problem), seed=s)
        if 0 < rec.k < rec.n:
            return rec, comps, model, tok
    raise AssertionError("no informative source group in 50 tries")


def test_s_matches_direct_length_normalised_likelihood_ratio(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    # Both fixtures share one character tokenizer, so re-tokenisation is the identity.
    tr, own = _receiver(tiny_llama, prompt_file, tmp_path, **{"graft.gate": False})
    with tr:
        g0 = own[0]
        rec, comps, src_model, src_tok = _informative_record(tiny_gpt2, tr, g0)
        result = receive(receiver_of(tr), own, {g0.prompt.id: rec})
        new = result.groups[0]
        assert new.source == "peer" and result.metrics["graft/replaced"] == 1
        resp = [c.token_ids for c in comps]
        for c_new, c_src in zip(new.completions, comps):
            assert c_new.token_ids == c_src.token_ids  # same tokenizer: same ids after re-tokenising
        batch = pack([g0.prompt_ids] * len(resp), resp, tr.tokenizer.pad_token_id)
        with torch.no_grad():
            lp_r = response_forward(tr.model, batch).logprobs
            lp_s = response_forward(src_model, batch).logprobs
        m = batch.response_mask
        direct = torch.exp((lp_r * m).sum(-1) / m.sum(-1) - (lp_s * m).sum(-1) / m.sum(-1))
        got = torch.tensor(result.metrics["graft/s_values"])
        torch.testing.assert_close(got, direct.float(), atol=1e-3, rtol=1e-3)
        # advantages are the source's, untouched
        assert new.advantages.tolist() == pytest.approx(list(rec.advantages))
        assert new.weights.tolist() == [1.0] * rec.n  # gate off


def test_gate_weights_follow_eq8(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    tr, own = _receiver(tiny_llama, prompt_file, tmp_path, **{"graft.delta": 0.5})
    with tr:
        rec, *_ = _informative_record(tiny_gpt2, tr, own[0])
        res = receive(receiver_of(tr), own, {own[0].prompt.id: rec})
        s = torch.tensor(res.metrics["graft/s_values"])
        w = res.groups[0].weights
        expected = torch.where(s > 0.5, s.clamp(max=1.0), torch.zeros_like(s))
        torch.testing.assert_close(w, expected, atol=1e-4, rtol=1e-4)


def test_lying_peer_is_rejected_and_counted(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    tr, own = _receiver(tiny_llama, prompt_file, tmp_path)
    with tr:
        rec, *_ = _informative_record(tiny_gpt2, tr, own[0])
        flipped = tuple(1.0 - r for r in rec.rewards)
        lie = GroupRecord(**{**rec.to_dict(), "rewards": flipped, "advantages": tuple(-a for a in rec.advantages)})
        res = receive(receiver_of(tr), own, {own[0].prompt.id: lie})
        assert res.metrics["graft/rejected_reverify"] == 1
        assert res.groups[0] is own[0]


def test_never_replaces_a_group_that_was_not_all_fail(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    tr, own = _receiver(tiny_llama, prompt_file, tmp_path)
    with tr:
        own[0].rewards = torch.tensor([1.0] + [0.0] * (own[0].n - 1))
        rec, *_ = _informative_record(tiny_gpt2, tr, own[0])
        res = receive(receiver_of(tr), own, {own[0].prompt.id: rec})
        assert res.metrics["graft/rejected_not_all_fail"] == 1 and res.groups[0] is own[0]


def test_stored_mode_trains_against_a_recorded_run(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    src_cfg = make_cfg(tiny_gpt2, prompt_file, tmp_path / "src", **{"rollout.n": 2, "run.name": "peer"})
    with GRPOTrainer(src_cfg, quiet=True) as src:
        src.train(evaluate_before_after=False)
    store_path = tmp_path / "src" / "trajectories.sqlite"
    with TrajectoryStore(store_path, readonly=True) as store:
        assert store.runs() == [("peer-seed7", "peer", 2 * 4)]
        assert store.run_advantage("peer-seed7") == "group/sample"
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "recv",
                   **{"rollout.n": 2, "graft.peer_store": str(store_path)})
    # a receiver that normalises its advantages otherwise is refused, naming both
    with pytest.raises(ConfigError, match="recorded with advantages normalised as group/sample.*none/sample"):
        StoredPeers(cfg.graft, "none/sample")
    with GRPOTrainer(cfg, quiet=True) as tr:
        peers = StoredPeers(cfg.graft, "group/sample")
        rows = [graft_step.step(tr, peers) for _ in range(2)]
        peers.close()
    for row in rows:
        assert row["graft/all_fail"] == pytest.approx(row["frac_all_fail"] * 4)
        assert row["graft/selected"] <= row["graft/candidates"] <= row["graft/all_fail"]
        assert row.get("graft/replaced", 0) + row.get("graft/rejected_reverify", 0) == row["graft/selected"]
        assert math.isnan(row["graft/admitted_frac"]) or 0 <= row["graft/admitted_frac"] <= 1


def test_replacements_are_counted_per_source_and_task_family(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    """graft/from/<source>/family/<family>/replaced|admitted: which slices each peer fills."""
    import dataclasses

    tr, own = _receiver(tiny_llama, prompt_file, tmp_path, **{"graft.delta": 0.0})
    with tr:
        own[0].prompt = dataclasses.replace(own[0].prompt, meta={**own[0].prompt.meta, "family": "add_carry"})
        rec, *_ = _informative_record(tiny_gpt2, tr, own[0])
        res = receive(receiver_of(tr), own, {own[0].prompt.id: rec})
        m = res.metrics
        admitted = int((res.groups[0].weights > 0).sum())
        assert m["graft/from/peer/family/add_carry/replaced"] == 1
        assert m["graft/from/peer/family/add_carry/admitted"] == admitted == rec.n  # delta 0 admits all
        assert not [k for k in m if "/family/" in k and "add_carry" not in k]
