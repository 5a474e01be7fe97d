"""modeling.response_forward: the entropy as a metric holds no graph of its own."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from graft_fed.modeling import pack, response_forward
from graft_fed.trainer.grpo import GRPOTrainer
from tests.trainer.test_grpo import make_cfg


def _saved_vocab_tensors(model, batch, **kw) -> tuple[set[int], object]:
    """The distinct (B, R, V) tensors the forward's autograd graph saves for backward."""
    vocab = model.config.vocab_size
    saved: set[int] = set()

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 3 and t.shape[-1] == vocab:
            saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fwd = response_forward(model, batch, **kw)
    return saved, fwd


def test_the_entropy_as_a_metric_adds_no_vocabulary_sized_tensor_to_the_graph_and_changes_nothing(tiny_llama):
    """The graph of a training forward keeps one (B, R, V) float32 tensor (the log-softmax);
    an entropy kept for the loss (an entropy bonus) adds its own; the log-probs, the entropy
    and the log-probs' gradients are the same either way."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    batch = pack([[5, 6, 7], [8, 9]] * 2, [[8, 9, 10, 11, 12], [13, 14]] * 2, 0)
    grads, outs = {}, {}
    for grad in (False, True):
        model.zero_grad(set_to_none=True)
        saved, fwd = _saved_vocab_tensors(model, batch, temperature=0.7, with_entropy=True, entropy_grad=grad)
        assert len(saved) == (2 if grad else 1)
        assert fwd.entropy.requires_grad is grad
        (fwd.logprobs * batch.response_mask).sum().backward()
        grads[grad] = [p.grad.clone() for p in model.parameters()]
        outs[grad] = fwd
    assert torch.equal(outs[False].logprobs.detach(), outs[True].logprobs.detach())
    assert torch.equal(outs[False].entropy, outs[True].entropy.detach())
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    with torch.no_grad():  # and without a graph at all, nothing is saved
        assert response_forward(model, batch, with_entropy=True, entropy_grad=True).entropy.requires_grad is False


def test_the_trainer_keeps_the_entropys_graph_exactly_when_its_loss_has_an_entropy_bonus(tiny_llama, prompt_file,
                                                                                       tmp_path):
    batch = pack([[5, 6, 7]], [[8, 9, 10]], 0)
    for coef in (0.0, 0.01):
        cfg = make_cfg(tiny_llama, prompt_file, tmp_path / f"run{coef}", **{"algorithm.entropy_coef": coef})
        with GRPOTrainer(cfg, quiet=True) as tr:
            assert tr._forward(tr.model, batch, with_entropy=True).entropy.requires_grad is (coef > 0)  # noqa: SLF001
