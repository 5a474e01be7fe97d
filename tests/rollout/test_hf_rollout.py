import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from graft_fed.modeling import pack, response_forward
from graft_fed.rollout.base import SamplingParams
from graft_fed.rollout.hf import HFRollout, filter_logits, stream_seed


def _load(path):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, tok


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_logprobs_match_teacher_forced_forward(arch, request):
    model, tok = _load(request.getfixturevalue(arch))
    engine = HFRollout(model, tok, batch_size=5, seed=3)
    prompts = ["Q: 1+2=?\nA: ", "Q: what is 12 + 345?\nA: ", "Q: x\nA: "]  # different lengths -> left padding
    sp = SamplingParams(n=3, temperature=0.7, max_new_tokens=12)
    groups = engine.generate(prompts, sp)
    assert [len(g) for g in groups] == [3, 3, 3]
    flat = [c for g in groups for c in g]
    batch = pack([c.prompt_token_ids for c in flat], [c.token_ids for c in flat], tok.pad_token_id)
    with torch.no_grad():
        fwd = response_forward(model, batch, temperature=0.7)
    for i, c in enumerate(flat):
        assert len(c.logprobs) == len(c.token_ids) >= 1
        got = fwd.logprobs[i, :len(c.token_ids)]
        torch.testing.assert_close(got, torch.tensor(c.logprobs), atol=2e-4, rtol=0)
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "length":
            assert len(c.token_ids) == sp.max_new_tokens
        else:
            assert c.token_ids[-1] == tok.eos_token_id


def test_same_seed_same_samples_and_rng_state_roundtrip(tiny_llama):
    model, tok = _load(tiny_llama)
    sp = SamplingParams(n=4, max_new_tokens=8)
    a = HFRollout(model, tok, seed=11)
    state = a.rng_state()
    first = [c.token_ids for c in a.generate(["Q: 7\nA: "], sp)[0]]
    a.set_rng_state(state)
    again = [c.token_ids for c in a.generate(["Q: 7\nA: "], sp)[0]]
    b = HFRollout(model, tok, seed=11)
    assert first == again == [c.token_ids for c in b.generate(["Q: 7\nA: "], sp)[0]]


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    # 0.5 + 0.3 reaches 0.8: the nucleus of 0.8 keeps exactly the first two tokens.
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.81)).tolist() == [[False, False, False, True]]
    assert not torch.isinf(filter_logits(logits, top_k=0, top_p=0.1)[0, 0])


def test_a_stream_state_from_another_device_type_reseeds_reproducibly_and_says_so(tiny_llama, caplog):
    """A checkpoint's rollout RNG state saved on a GPU (CUDA's generator state is 16 bytes) and
    resumed on a CPU (5,056) cannot continue that stream: each engine resumed from it samples
    what the stream seeded from those bytes samples, and the log says so. A state of no
    generator's size is refused (the trainer's resume turns that into a checkpoint error)."""
    model, tok = _load(tiny_llama)
    sp = SamplingParams(n=4, max_new_tokens=8)
    foreign = torch.arange(16, dtype=torch.uint8)
    runs = []
    for _ in range(2):
        engine = HFRollout(model, tok, seed=11)
        with caplog.at_level("WARNING", logger="graft_fed.rollout.hf"):
            engine.set_rng_state(foreign)
        runs.append([c.token_ids for c in engine.generate(["Q: 7\nA: "], sp)[0]])
    reseeded = HFRollout(model, tok, seed=stream_seed(*range(16)))
    assert runs[0] == runs[1] == [c.token_ids for c in reseeded.generate(["Q: 7\nA: "], sp)[0]]
    assert runs[0] != [c.token_ids for c in HFRollout(model, tok, seed=11).generate(["Q: 7\nA: "], sp)[0]]
    warnings = [r.getMessage() for r in caplog.records if r.name == "graft_fed.rollout.hf"]
    assert len(warnings) == 2 and "is a CUDA generator's and this engine samples on cpu" in warnings[0]
    assert engine.generator.get_state().numel() == 5056  # still this device's generator
    with pytest.raises(ValueError, match="has 100 bytes, which is no generator's"):
        engine.set_rng_state(torch.zeros(100, dtype=torch.uint8))
