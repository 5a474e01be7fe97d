"""A receiver fed a poisoned peer group (huge advantages, absurd claimed log-probs) keeps
finite weights: the record's own validation, run by the receiver before anything else,
refuses it (issue 12, class 3). The screening and guard helpers it will also call are
tested in tests/core/test_screening.py."""

import dataclasses

import torch

from graft_fed.core.records import RecordError
from graft_fed.core.screening import screen_record
from graft_fed.federation.bundles import decode_bundle, digest_of
from tests.trainer.test_graft_receive import _informative_record, _receiver

from graft_fed.graft.receive import receive
from graft_fed.graft.step import receiver_of


def test_a_poisoned_group_is_refused_reported_and_the_weights_stay_finite(tiny_llama, tiny_gpt2, prompt_file,
                                                                          tmp_path):
    import json

    tr, own = _receiver(tiny_llama, prompt_file, tmp_path)
    with tr:
        rec, *_ = _informative_record(tiny_gpt2, tr, own[0])
        poisons = {
            "huge advantages": (dataclasses.replace(rec, advantages=tuple(1e300 if r > 0.5 else -1e300
                                                                          for r in rec.rewards)), True),
            "absurd log-probs": (dataclasses.replace(rec, mean_logprobs=(-1e6,) * rec.n), True),
            # the right signs and sizes, but not Eq. 1 of these rewards: only the receiver's
            # recomputation can tell
            "inflated advantages": (dataclasses.replace(rec, advantages=tuple(1.5 * a for a in rec.advantages)),
                                    False),
        }
        before = [p.detach().clone() for p in tr.model.parameters()]
        for what, (bad, undecodable) in poisons.items():
            try:
                screen_record(bad)
                raise AssertionError(f"{what}: screening let it through")
            except RecordError:
                pass
            if undecodable:
                data = json.dumps(bad.to_dict()).encode()  # as a hostile broker or peer would send it
                try:
                    decode_bundle(data, digest_of(data))
                    raise AssertionError(f"{what}: decoded")
                except RecordError:
                    pass
            res = receive(receiver_of(tr), own, {own[0].prompt.id: bad})
            assert sum(v for k, v in res.metrics.items() if k.startswith("graft/rejected_")) == 1, what
            assert res.groups[0] is own[0]
            assert [(r.source, r.prompt_id, r.rejected) for r in res.reports] == [(rec.model_id, rec.prompt_id, True)]
            tr.optimise(res.groups)
            assert all(bool(torch.isfinite(p).all()) for p in tr.model.parameters()), what
        assert res.metrics["graft/rejected_advantages"] == 1  # the inflated claim, by name
        # the honest record passes the same screening and is trained on
        res = receive(receiver_of(tr), own, {own[0].prompt.id: rec})
        assert res.metrics["graft/replaced"] == 1
        assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def test_a_peer_response_longer_than_the_receiver_takes_is_refused_before_scoring(tiny_gpt2, prompt_file, tmp_path):
    """A hostile peer's group whose responses, re-tokenised, run past the receiver's model
    context (GPT-2's 512 learned positions here: an IndexError in the scoring pass; on a
    long-context model the scoring pass's memory grows with the response instead) or past
    graft.max_peer_tokens is refused before any model sees it, and reported as unusable
    (s 0, not as a lie: an honest peer with a longer cap sends such groups too)."""
    for sub, over in (("default", {}), ("beyond_context", {"graft.max_peer_tokens": 10**6})):
        (tmp_path / sub).mkdir()
        tr, own = _receiver(tiny_gpt2, prompt_file, tmp_path / sub, **over)
        with tr:
            rec, *_ = _informative_record(tiny_gpt2, tr, own[0])
            # 600 more characters of even character-code sum: the rewards still re-verify
            long = dataclasses.replace(rec, texts=tuple("a" * 600 + t for t in rec.texts))
            res = receive(receiver_of(tr), own, {own[0].prompt.id: long})
            assert res.metrics["graft/rejected_too_long"] == 1, sub
            assert res.groups[0] is own[0]
            assert [(r.source, r.prompt_id, r.mean_s, r.rejected) for r in res.reports] == \
                [(rec.model_id, rec.prompt_id, 0.0, False)]
            # the same group within bounds is trained on
            res = receive(receiver_of(tr), own, {own[0].prompt.id: rec})
            assert res.metrics["graft/replaced"] == 1 and "graft/rejected_too_long" not in res.metrics


def test_special_token_strings_in_a_peer_response_are_retokenised_as_plain_text(tiny_llama):
    """Responses are decoded without special tokens, so only a hostile peer's text holds
    "<eos>" or "<pad>" (a real model's "<|im_end|><|im_start|>user"): re-tokenised as those
    tokens they put end-of-turn, role or pad ids inside what the receiver trains on, at
    weight 1 once the source claims low log-probs. They are read as the text they are."""
    from transformers import AutoTokenizer

    from graft_fed.graft.receive import retokenise

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    specials = {tok.eos_token_id, tok.pad_token_id}
    ids = retokenise(tok, "12<eos>34<pad>", "stop", tok.eos_token_id)
    assert ids[-1] == tok.eos_token_id and not specials & set(ids[:-1])
    assert retokenise(tok, "1234", "length", tok.eos_token_id) == tok("1234", add_special_tokens=False)["input_ids"]
    # the tokenizer is left as it was: its own calls still read special tokens
    assert tok.eos_token_id in tok("12<eos>", add_special_tokens=False)["input_ids"]


def test_a_peer_group_the_verifier_could_not_finish_is_not_trained_on(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    """A hostile peer's group: one right answer and responses math-verify never finishes
    ("\\boxed{9^{9^{9^9}}}": each costs the verifier's whole timeout, 20 s for seven of them
    with two workers), claimed 0, which is what a timeout scores: re-verification agreed and
    the group was trained on, every step it was matched. A response the verifier could not
    finish is not verified: the group is refused and reported as unusable (s 0)."""
    from graft_fed.rewards.verifier import ScoreResult

    tr, own = _receiver(tiny_llama, prompt_file, tmp_path)
    with tr:
        rec, *_ = _informative_record(tiny_gpt2, tr, own[0])
        zero = rec.rewards.index(0.0)

        class TimesOut:
            def score(self, texts, answers):
                got = tr.verifier.score(texts, answers)
                statuses = ["ok"] * len(texts)
                statuses[zero] = "timeout"  # scored 0, as the pool scores a timeout
                return ScoreResult.from_statuses(list(got.rewards), statuses)

        rx = dataclasses.replace(receiver_of(tr), verifier=TimesOut())
        res = receive(rx, own, {own[0].prompt.id: rec})
        assert res.metrics["graft/rejected_unverifiable"] == 1 and "graft/replaced" not in res.metrics
        assert res.groups[0] is own[0]
        assert [(r.source, r.prompt_id, r.mean_s, r.rejected) for r in res.reports] == \
            [(rec.model_id, rec.prompt_id, 0.0, False)]
        assert receive(receiver_of(tr), own, {own[0].prompt.id: rec}).metrics["graft/replaced"] == 1
