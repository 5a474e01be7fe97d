"""The vLLM rollout backend.

Everything but the last test runs on CPU without vllm: a fake `LLM` shaped like vLLM's
(RequestOutput / CompletionOutput / Logprob, sleep / wake_up(tags) / reset_prefix_cache,
the in-process driver worker's model with load_weights, collective_rpc) samples with a
real tiny transformers model, so the conversion, log-prob, EOS, seeding, weight-sync and
sleep/wake logic is checked against a teacher-forced forward pass. Its collective_rpc
crosses a process boundary built like vLLM V1's (`RpcBoundary`: msgpack without type
hints, tensors as [dtype, shape, buffer]), so only what survives that reaches a worker.
The last test needs vllm and a CUDA GPU and runs the real engine.
"""

from __future__ import annotations

import copy
import inspect
import logging
import pickle
import sys
from dataclasses import dataclass
from types import FunctionType, SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from graft_fed.errors import ConfigError
from graft_fed.modeling import pack, response_forward
from graft_fed.rollout import vllm as vb
from graft_fed.rollout.base import SamplingParams
from graft_fed.rollout.hf import _cache_kwarg, filter_logits
from graft_fed.trainer.config import VllmSection

# ----- fakes shaped like vLLM's objects --------------------------------------------------------


@dataclass
class FakeLogprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeCompletionOutput:
    index: int
    text: str
    token_ids: tuple
    cumulative_logprob: float | None
    logprobs: Any
    finish_reason: str | None
    stop_reason: Any = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list


class RpcBoundary:
    """What a collective_rpc call's arguments and results go through between vLLM V1's
    front-end and its engine process: msgpack (msgspec) encoding with vLLM's fallbacks, and
    decoding WITHOUT type hints, as vLLM decodes utility calls. So tuples come back as
    lists, a tensor comes back as [dtype, shape, data] (data: inline bytes below
    `inline_below` bytes, else the index of an out-of-band buffer), a function by reference
    (vLLM cloudpickles it; a module-level function pickles the same way), and anything else
    msgpack has no type for is pickled (VLLM_ALLOW_INSECURE_SERIALIZATION=1). Bytes pass
    unchanged."""

    _PICKLE, _FUNCTION, _RAW = 1, 2, 3

    def __init__(self, inline_below: int = 256) -> None:
        self.inline_below = inline_below
        self.buffers: list[bytes] = []
        self.encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self.decoder = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)  # no type: Any

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            raw = obj.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
            if len(raw) < self.inline_below:
                data: Any = msgspec.msgpack.Ext(self._RAW, raw)
            else:
                data = len(self.buffers) + 1  # buffer 0 is the message itself
                self.buffers.append(raw)
            return str(obj.dtype).removeprefix("torch."), tuple(obj.shape), data
        if isinstance(obj, FunctionType):
            return msgspec.msgpack.Ext(self._FUNCTION, pickle.dumps(obj))
        return msgspec.msgpack.Ext(self._PICKLE, pickle.dumps(obj))

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == self._RAW:
            return bytes(data)
        return pickle.loads(data)

    def cross(self, obj: Any) -> Any:
        self.buffers = []
        return self.decoder.decode(self.encoder.encode(obj))


class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


class FakeVllmModel:
    """vLLM's model object: load_weights takes (Hugging Face name, tensor) pairs."""

    def __init__(self, hf: Any, events: list) -> None:
        self.hf = hf
        self.events = events

    def load_weights(self, weights):
        state = self.hf.state_dict()
        names = []
        for name, tensor in weights:
            if name not in state:
                raise KeyError(name)
            state[name].copy_(tensor)  # state_dict tensors share storage with the parameters
            names.append(name)
        self.events.append(("load_weights", len(names)))
        return set(names)


class FakeLLM:
    """Samples like vLLM: per-request seeded, stops at stop_token_ids (kept in the output),
    reports the sampled token's raw or processed log-prob."""

    def __init__(self, model: str, seed: int = 0, enable_sleep_mode: bool = False,
                 logprobs_mode: str = "processed_logprobs", in_process: bool = True, workers: int = 1,
                 length_before_stop: bool = False, eos_on_last_step: bool = False, **kwargs: Any) -> None:
        self.kwargs = dict(model=model, seed=seed, enable_sleep_mode=enable_sleep_mode,
                           logprobs_mode=logprobs_mode, **kwargs)
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.events: list = []
        self.sleep_mode = enable_sleep_mode
        self.logprobs_mode = logprobs_mode
        # vLLM 0.10.2 checks the length cap before the stop tokens (see finish_reason)
        self.length_before_stop = length_before_stop
        self.eos_on_last_step = eos_on_last_step  # the last allowed token is the first stop id
        self.awake = {"weights", "kv_cache"}
        self.vllm_model = FakeVllmModel(self.hf, self.events)
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.vllm_model))
        if in_process:
            self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)))
        else:
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace())  # V1 multiprocess client
            # tensor parallelism: every worker gets the full tensors and loads them (a fake
            # shard: each loads the same model, so a wrong tensor fails on any of them)
            self._workers = [worker] * workers
            self.boundary = RpcBoundary()

    def sleep(self, level: int = 1) -> None:
        assert self.sleep_mode, "sleep() needs enable_sleep_mode=True"
        self.events.append(("sleep", level))
        self.awake = set()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append(("wake_up", tuple(tags) if tags is not None else None))
        self.awake |= set(tags) if tags is not None else {"weights", "kv_cache"}

    def reset_prefix_cache(self) -> bool:
        self.events.append(("reset_prefix_cache",))
        return True

    def generate(self, prompts, sampling_params, use_tqdm=True):
        if self.kwargs.get("skip_tokenizer_init") and any(sp.detokenize for sp in sampling_params):
            raise ValueError("detokenize needs a tokenizer, and skip_tokenizer_init is set")
        if self.awake != {"weights", "kv_cache"}:
            raise RuntimeError(f"generate while asleep (awake: {sorted(self.awake)})")
        self.events.append(("generate", len(prompts)))
        return [self._request(i, p["prompt_token_ids"], sp) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]

    @torch.no_grad()
    def _request(self, i: int, prompt_ids: list[int], sp: FakeSamplingParams) -> FakeRequestOutput:
        """The request's n samples decode together, one token a step through the model's KV
        cache (the same prompt, so no padding; a finished sample's row is fed a dummy token
        and ignored). Draws come from the request's generator in sample order each step."""
        gen = torch.Generator().manual_seed(sp.seed)
        n, cache_kw = sp.n, _cache_kwarg(self.hf)
        step = self.hf(torch.tensor([list(prompt_ids)] * n), use_cache=True)
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[dict]] = [[] for _ in range(n)]
        reasons, live = ["length"] * n, [sp.max_tokens > 0] * n  # vLLM refuses max_tokens < 1; no tokens then
        while any(live):
            logits = step.logits[:, -1].float()
            raw = torch.log_softmax(logits, -1)
            proc = torch.log_softmax(filter_logits(logits / sp.temperature, max(sp.top_k, 0), sp.top_p), -1)
            fed = []
            for j in range(n):
                if not live[j]:
                    fed.append(0)
                    continue
                tok = int(torch.multinomial(proc[j].exp(), 1, generator=gen))
                if self.eos_on_last_step and len(toks[j]) == sp.max_tokens - 1:
                    tok = sp.stop_token_ids[0]
                lp = float((raw if self.logprobs_mode == "raw_logprobs" else proc)[j, tok])
                toks[j].append(tok)
                lps[j].append({tok: FakeLogprob(lp, 1, "?")})
                fed.append(tok)
                if len(toks[j]) == sp.max_tokens:
                    live[j] = False  # the cap; the reason is "stop" if that token stops, unless
                    if tok in sp.stop_token_ids and not self.length_before_stop:  # length_before_stop
                        reasons[j] = "stop"
                elif tok in sp.stop_token_ids:
                    reasons[j], live[j] = "stop", False
            if not any(live):
                break
            step = self.hf(torch.tensor(fed).unsqueeze(1), use_cache=True, **{cache_kw: getattr(step, cache_kw)})
        outputs = [FakeCompletionOutput(index=j, text="(vLLM's own text)", token_ids=tuple(toks[j]),
                                        cumulative_logprob=sum(d[t].logprob for d, t in zip(lps[j], toks[j])),
                                        logprobs=lps[j], finish_reason=reasons[j],
                                        stop_reason=toks[j][-1] if reasons[j] == "stop" else None)
                   for j in range(n)]
        # vLLM does not promise the samples of a request in index order
        return FakeRequestOutput(request_id=str(i), prompt_token_ids=list(prompt_ids), outputs=outputs[::-1])

    def collective_rpc(self, method, args=(), kwargs=None):
        assert not hasattr(self.llm_engine, "model_executor"), "the in-process fake has no RPC"
        # front-end -> engine process: what the workers get is what survived msgpack
        method, args, kwargs = self.boundary.cross((method, args, kwargs or {}))
        results = [method(worker, *args, **kwargs) for worker in self._workers]
        return self.boundary.cross(results)  # and the results come back the same way


class OldWakeLLM(FakeLLM):
    """A release whose wake_up takes no tags."""

    def wake_up(self) -> None:  # type: ignore[override]
        super().wake_up(None)


def fake_vllm_module(llm_cls=FakeLLM):
    return SimpleNamespace(LLM=llm_cls, SamplingParams=FakeSamplingParams, __version__="fake")


def make_engine(model_dir, seed=0, sleep=True, logprobs_mode="processed_logprobs", llm_cls=FakeLLM, **llm_kwargs):
    tok = AutoTokenizer.from_pretrained(model_dir)
    llm = llm_cls(str(model_dir), seed=seed, enable_sleep_mode=sleep, logprobs_mode=logprobs_mode, **llm_kwargs)
    engine = vb.VLLMRollout(llm, tok, FakeSamplingParams, seed=seed, eos_ids=[tok.eos_token_id], sleep=sleep,
                            logprobs_mode=logprobs_mode, weight_dtype=torch.float32)
    return engine, llm, tok


PROMPTS = ["Q: 1+2=?\nA: ", "Q: what is 12 + 345?\nA: ", "Q: x\nA: "]


def teacher_forced(model, tok, completions, temperature=1.0):
    batch = pack([c.prompt_token_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
    with torch.no_grad():
        return response_forward(model, batch, temperature=temperature).logprobs


# ----- install / hardware errors -----------------------------------------------------------------


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'graft-fed\[vllm\]'.*CUDA GPU"):
        vb.import_vllm()
    with pytest.raises(ConfigError, match="graft-fed"):
        vb.build_vllm_engine("unused", None, None, VllmSection(), seed=0, add_special_tokens=False)


def test_needs_cuda_and_the_trainers_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*rollout.backend: hf"):
        vb.require_cuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    vb.require_cuda(torch.device("cuda"))
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        vb.require_cuda(torch.device("cuda:1"))
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        vb.require_cuda(torch.device("cpu"))


# ----- parameter mapping --------------------------------------------------------------------------


def test_sampling_params_mapping():
    sp = SamplingParams(n=8, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4096)
    kw = vb.sampling_kwargs(sp, seed=1234, stop_token_ids=[2, 151643])
    assert kw["n"] == 8 and kw["seed"] == 1234 and kw["max_tokens"] == 4096
    assert kw["stop_token_ids"] == [2, 151643] and kw["ignore_eos"] is False
    assert kw["logprobs"] == 0  # the sampled token's log-prob only
    assert kw["top_k"] == -1 and kw["top_p"] == 1.0 and kw["temperature"] == 1.0 and kw["min_p"] == 0.0
    assert kw["repetition_penalty"] == 1.0 and kw["presence_penalty"] == 0.0 and kw["frequency_penalty"] == 0.0
    assert kw["detokenize"] is False  # graft-fed decodes with its own tokenizer, as the hf backend
    assert vb.sampling_kwargs(SamplingParams(top_k=20, top_p=0.9), 0, [1])["top_k"] == 20


def test_engine_kwargs_mapping():
    kw = vb.engine_kwargs("/m", VllmSection(), seed=3, bf16_supported=True)
    assert kw["model"] == "/m" and kw["seed"] == 3 and kw["dtype"] == "bfloat16"
    # vLLM never loads the tokenizer (the zoo's name a class only transformers 5 has):
    # prompts go in as token ids and graft-fed decodes
    assert kw["skip_tokenizer_init"] is True and "tokenizer" not in kw
    assert kw["enable_sleep_mode"] is True and kw["tensor_parallel_size"] == 1
    assert kw["gpu_memory_utilization"] == 0.3 and kw["logprobs_mode"] == "processed_logprobs"
    assert "max_model_len" not in kw  # the model's maximum
    assert vb.engine_kwargs("/m", VllmSection(), 0, bf16_supported=False)["dtype"] == "float16"
    opts = VllmSection(dtype="fp32", max_model_len=6144, tensor_parallel_size=2, sleep=False,
                       gpu_memory_utilization=0.45, enforce_eager=True, logprobs_mode="raw_logprobs")
    kw = vb.engine_kwargs("/m", opts, 0, True)
    assert (kw["dtype"], kw["max_model_len"], kw["tensor_parallel_size"], kw["enable_sleep_mode"]) == \
        ("float32", 6144, 2, False)
    assert kw["gpu_memory_utilization"] == 0.45 and kw["enforce_eager"] and kw["logprobs_mode"] == "raw_logprobs"


def test_temperature_vllm_rejects_is_a_config_error():
    assert vb.sampling_kwargs(SamplingParams(temperature=2.0), 0, [1])["temperature"] == 2.0
    with pytest.raises(ConfigError, match=r"rollout.temperature is 2.5.*\(0, 2\].*rollout.backend: hf"):
        vb.sampling_kwargs(SamplingParams(temperature=2.5), 0, [1])


def test_vllm_config_validation():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        VllmSection(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="logprobs_mode"):
        VllmSection(logprobs_mode="raw_logits")
    with pytest.raises(ConfigError, match="dtype"):
        VllmSection(dtype="int8")


def test_bias_warning_text():
    assert vb.logprob_bias_warning(SamplingParams(), "raw_logprobs") is None
    assert vb.logprob_bias_warning(SamplingParams(), "processed_logprobs") is None
    raw = vb.logprob_bias_warning(SamplingParams(temperature=0.7), "raw_logprobs")
    assert "temperature 0.7" in raw and "biased" in raw and "processed_logprobs" in raw
    raw = vb.logprob_bias_warning(SamplingParams(top_p=0.95, top_k=20), "raw_logprobs")
    assert "top_p 0.95" in raw and "top_k 20" in raw
    tempered = vb.logprob_bias_warning(SamplingParams(temperature=0.7), "processed_logprobs")
    assert "untempered" in tempered and "biased" not in tempered
    truncated = vb.logprob_bias_warning(SamplingParams(top_p=0.9), "processed_logprobs")
    assert "truncated" in truncated and "biased" in truncated


# ----- RequestOutput -> Completion -----------------------------------------------------------------


class CharTok:
    """decode() like a tokenizer: id 1 is the special EOS, skipped."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<eos>" if i == 1 and not skip_special_tokens else "" if i == 1 else chr(96 + i)
                       for i in ids)


def test_completion_from_output_stop_and_length():
    decode = lambda ids: CharTok().decode(ids, skip_special_tokens=True)  # noqa: E731
    stopped = FakeCompletionOutput(0, "ignored", (3, 4, 1), -3.0,
                                   [{3: FakeLogprob(-0.5)}, {4: FakeLogprob(-1.5), 9: FakeLogprob(-0.1)}, {1: -1.0}],
                                   "stop", stop_reason=1)
    c = vb.completion_from_output(stopped, [7, 8], decode)
    assert c.token_ids == [3, 4, 1]  # the EOS stays, as in the hf backend
    assert c.logprobs == [-0.5, -1.5, -1.0] and c.finish_reason == "stop"
    assert c.text == "cd" and c.prompt_token_ids == [7, 8]
    cut = FakeCompletionOutput(0, "", (5, 5), None, [{5: FakeLogprob(-2.0)}, {5: FakeLogprob(-2.5)}], "length")
    c = vb.completion_from_output(cut, [7], decode)
    assert c.finish_reason == "length" and c.token_ids == [5, 5] and c.mean_logprob == -2.25


def test_eos_sampled_as_the_last_allowed_token_is_stop():
    # vLLM 0.10.2 reports it as "length" (it checks the cap first); 0.33 and the hf backend say "stop"
    eos_at_cap = FakeCompletionOutput(0, "", (3, 1), None, [{3: -0.5}, {1: -0.2}], "length")
    c = vb.completion_from_output(eos_at_cap, [7], lambda ids: "", stop_token_ids=[1, 2])
    assert c.finish_reason == "stop" and c.token_ids == [3, 1]
    assert vb.finish_reason("length", [3, 2], [1, 2]) == "stop"  # any stop id, not only the first
    assert vb.finish_reason("length", [1, 3], [1]) == "length"  # an EOS earlier is not a stop
    assert vb.finish_reason("length", [], [1]) == "length"
    assert vb.finish_reason("stop", [3, 1], [1]) == "stop"
    with pytest.raises(RuntimeError, match="aborted"):
        vb.finish_reason("abort", [1], [1])


@pytest.mark.parametrize("output, message", [
    (FakeCompletionOutput(0, "", (3,), None, [{3: FakeLogprob(-1.0)}], "abort"), "aborted"),
    (FakeCompletionOutput(0, "", (3,), None, None, "stop"), "logprobs=0"),
    (FakeCompletionOutput(0, "", (3,), None, [{4: FakeLogprob(-1.0)}], "stop"), "sampled token 3"),
    (FakeCompletionOutput(0, "", (3, 4), None, [{3: FakeLogprob(-1.0)}], "stop"), "1 log-prob entries for 2"),
])
def test_completion_from_output_errors(output, message):
    with pytest.raises(RuntimeError, match=message):
        vb.completion_from_output(output, [1], lambda ids: "")


def test_group_orders_by_index_and_checks_n():
    outs = [FakeCompletionOutput(i, "", (i + 2,), None, [{i + 2: float(-i)}], "length") for i in (2, 0, 1)]
    group = vb.group_from_request_output(FakeRequestOutput("0", [1], outs), [1], 3, lambda ids: "")
    assert [c.token_ids for c in group] == [[2], [3], [4]]
    with pytest.raises(RuntimeError, match="asked for n=4"):
        vb.group_from_request_output(FakeRequestOutput("0", [1], outs), [1], 4, lambda ids: "")


# ----- weights ----------------------------------------------------------------------------------------


def test_weight_names_drop_wrappers():
    assert vb.vllm_weight_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert vb.vllm_weight_name("_orig_mod.model.layers.3._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.3.mlp.up_proj.weight"
    assert vb.vllm_weight_name("module._fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"


def test_iter_weights_streams_state_dict_cast_and_gathered(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    got = list(vb.iter_weights(model, torch.bfloat16))
    assert [n for n, _ in got] == list(model.state_dict())
    assert all(t.dtype == torch.bfloat16 for _, t in got)
    ref = model.state_dict()
    for name, t in got:
        torch.testing.assert_close(t, ref[name].to(torch.bfloat16))

    class Sharded:  # a DTensor's interface: full_tensor() gathers the shards
        def __init__(self, t):
            self.t = t

        def full_tensor(self):
            return self.t

    wrapped = SimpleNamespace(state_dict=lambda: {"_orig_mod.w": Sharded(torch.ones(2, dtype=torch.float32)),
                                                  "_orig_mod.steps": torch.tensor([3])})
    (n1, t1), (n2, t2) = vb.iter_weights(wrapped, torch.float16)
    assert (n1, t1.dtype, n2, t2.dtype) == ("w", torch.float16, "steps", torch.int64)  # integers are not cast


SHARED: dict[int, torch.Tensor] = {}


def _open_shared(key: int) -> torch.Tensor:
    """Stands in for torch's rebuild_cuda_tensor: opens the memory a handle names."""
    return SHARED[key]


def test_weight_payload_crosses_vllms_rpc_boundary(monkeypatch):
    boundary = RpcBoundary(inline_below=64)
    chunk = [("a.weight", torch.randn(4, 8, dtype=torch.bfloat16)), ("b.bias", torch.arange(3.0)),
             ("steps", torch.tensor([7]))]
    # what the old backend sent (tuples, tensors) does not survive: the worker sees lists
    naive = boundary.cross(([(n, t) for n, t in chunk],))
    assert naive[0][0][0] == "a.weight" and isinstance(naive[0][0][1], list) and naive[0][0][1][0] == "bfloat16"
    with pytest.raises(TypeError, match="expected the bytes of graft_fed.rollout.vllm.encode_weight_chunk"):
        vb.decode_weight_chunk(naive[0])

    for same_gpu in (False, True):  # CPU tensors travel as copies whatever same_gpu says
        got = vb.decode_weight_chunk(boundary.cross(vb.encode_weight_chunk(chunk, same_gpu)))
        assert [n for n, _ in got] == [n for n, _ in chunk]
        for (_, want), (_, have) in zip(chunk, got):
            assert have.dtype == want.dtype and torch.equal(have, want)

    # tensor parallelism 1 with the trainer on this GPU: (rebuild, args) handles, not copies
    def handle(t):
        SHARED[len(SHARED)] = t
        return _open_shared, (len(SHARED) - 1,)

    monkeypatch.setattr(vb, "_on_gpu", lambda t: True)
    monkeypatch.setattr(vb, "_ipc_handle", handle)
    SHARED.clear()
    got = vb.decode_weight_chunk(boundary.cross(vb.encode_weight_chunk(chunk, same_gpu=True)))
    assert all(have is want for (_, want), (_, have) in zip(chunk, got))  # opened in place, never copied
    assert len(vb.decode_weight_chunk(boundary.cross(vb.encode_weight_chunk(chunk, same_gpu=False)))) == 3
    assert len(SHARED) == 3  # same_gpu=False (tensor parallelism > 1) never hands out handles


def test_chunked_bounds_bytes():
    ts = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(30)), ("d", torch.zeros(1))]
    sizes = [[n for n, _ in c] for c in vb.chunked(ts, max_bytes=80)]
    assert sizes == [["a", "b"], ["c"], ["d"]]  # 40 + 40 bytes fit; a 120-byte tensor travels alone


# ----- the engine, end to end on a tiny model ---------------------------------------------------


def test_generate_matches_teacher_forced_logprobs(tiny_llama):
    engine, llm, tok = make_engine(tiny_llama, seed=5)
    sp = SamplingParams(n=3, max_new_tokens=12)
    groups = engine.generate(PROMPTS, sp)
    assert [len(g) for g in groups] == [3, 3, 3]
    flat = [c for g in groups for c in g]
    fwd = teacher_forced(llm.hf, tok, flat)
    saw = set()
    for i, c in enumerate(flat):
        assert len(c.logprobs) == len(c.token_ids) >= 1
        torch.testing.assert_close(fwd[i, :len(c.token_ids)], torch.tensor(c.logprobs), atol=2e-4, rtol=0)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)  # not vLLM's own text
        saw.add(c.finish_reason)
        if c.finish_reason == "length":
            assert len(c.token_ids) == sp.max_new_tokens and tok.eos_token_id not in c.token_ids
        else:
            assert c.token_ids[-1] == tok.eos_token_id
    assert groups[1][0].prompt_token_ids == tok(PROMPTS[1], add_special_tokens=False)["input_ids"]
    assert "length" in saw


def test_processed_logprobs_at_a_temperature(tiny_llama, caplog):
    engine, llm, tok = make_engine(tiny_llama, seed=1, logprobs_mode="processed_logprobs")
    sp = SamplingParams(n=2, temperature=0.7, max_new_tokens=6)
    with caplog.at_level(logging.WARNING, logger="graft_fed.rollout.vllm"):
        flat = [c for g in engine.generate(PROMPTS[:2], sp) for c in g]
        engine.generate(PROMPTS[:1], sp)
    fwd = teacher_forced(llm.hf, tok, flat, temperature=0.7)
    for i, c in enumerate(flat):
        torch.testing.assert_close(fwd[i, :len(c.token_ids)], torch.tensor(c.logprobs), atol=2e-4, rtol=0)
    warnings = [r for r in caplog.records if "temperature 0.7" in r.getMessage()]
    assert len(warnings) == 1  # once per engine, not every step


def test_seeds_reproduce_and_rng_state_resumes(tiny_llama):
    a, _, _ = make_engine(tiny_llama, seed=11)
    b, _, _ = make_engine(tiny_llama, seed=11)
    sp = SamplingParams(n=2, max_new_tokens=5)
    ids = lambda groups: [c.token_ids for g in groups for c in g]  # noqa: E731
    state = a.rng_state()
    first = ids(a.generate(PROMPTS[:2], sp))
    assert first == ids(b.generate(PROMPTS[:2], sp))
    assert ids(a.generate(PROMPTS[:2], sp)) != first  # a new call draws new seeds
    a.set_rng_state(state)
    assert ids(a.generate(PROMPTS[:2], sp)) == first
    keyed = ids(a.generate(PROMPTS[:2], sp, seeds=[5, 6]))
    assert ids(b.generate(PROMPTS[1:2], sp, seeds=[6])) == keyed[2:]  # a prompt's key alone fixes its samples
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        a.generate(PROMPTS[:1], sp, seeds=[1, 2])
    seeds = {vb.request_seed(11, call, i) for call in range(3) for i in range(3)}
    assert len(seeds) == 9 and all(0 <= s < 2**31 for s in seeds)


def test_sleep_wake_ordering_and_weight_sync(tiny_llama, monkeypatch):
    engine, llm, tok = make_engine(tiny_llama, seed=2)
    # PyTorch's cache must be emptied before vLLM takes memory back (a no-op on CPU, so recorded)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: llm.events.append(("empty_cache",)))
    assert llm.events == [("sleep", 1)]  # asleep until the first rollout
    sp = SamplingParams(n=2, max_new_tokens=6)
    engine.generate(PROMPTS[:1], sp)
    assert llm.events[1:] == [("empty_cache",), ("wake_up", ("kv_cache", "weights")), ("generate", 1), ("sleep", 1)]

    trainer = copy.deepcopy(llm.hf)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(3.0)  # tied to the embeddings: changes every logit
        trainer.model.layers[0].mlp.up_proj.weight.add_(0.5)
    engine.sync_weights(trainer)
    assert llm.events[-1] == ("sleep", 1)  # sync_weights alone touches nothing
    del llm.events[:]
    groups = engine.generate(PROMPTS, sp)
    n_tensors = len(trainer.state_dict())
    assert llm.events == [("empty_cache",), ("wake_up", ("weights",)), ("load_weights", n_tensors),
                          ("reset_prefix_cache",), ("empty_cache",), ("wake_up", ("kv_cache",)), ("generate", 3),
                          ("sleep", 1)]
    for name, t in trainer.state_dict().items():
        torch.testing.assert_close(llm.hf.state_dict()[name], t)
    flat = [c for g in groups for c in g]
    torch.testing.assert_close(teacher_forced(trainer, tok, flat)[0, :len(flat[0].token_ids)],
                               torch.tensor(flat[0].logprobs), atol=2e-4, rtol=0)
    del llm.events[:]
    engine.generate(PROMPTS[:1], sp)  # nothing pending: no second copy
    assert [e[0] for e in llm.events] == ["empty_cache", "wake_up", "generate", "sleep"]


def test_without_sleep_mode_the_engine_stays_awake(tiny_llama):
    engine, llm, _ = make_engine(tiny_llama, sleep=False)
    engine.sync_weights(copy.deepcopy(llm.hf))
    engine.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=4))
    assert [e[0] for e in llm.events] == ["load_weights", "reset_prefix_cache", "generate"]


def test_wake_up_without_tags_wakes_everything(tiny_llama):
    engine, llm, _ = make_engine(tiny_llama, llm_cls=OldWakeLLM)
    assert "tags" not in inspect.signature(llm.wake_up).parameters
    engine.sync_weights(copy.deepcopy(llm.hf))
    engine.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=4))
    assert [e[0] for e in llm.events] == ["sleep", "wake_up", "load_weights", "reset_prefix_cache", "generate", "sleep"]


@pytest.mark.parametrize("workers", [1, 2])
def test_weights_reach_a_multiprocess_engine_through_rpc_in_chunks(tiny_llama, monkeypatch, workers):
    """vLLM V1's default: the engine in its own process, reached through msgpack (RpcBoundary)."""
    engine, llm, tok = make_engine(tiny_llama, in_process=False, workers=workers)
    engine.same_gpu = workers == 1
    assert vb._engine_model(llm)[0] == "rpc"
    monkeypatch.setattr(vb, "RPC_CHUNK_BYTES", 4096)
    trainer = copy.deepcopy(llm.hf)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    assert engine.load_weights(trainer) == len(trainer.state_dict())
    loads = [e for e in llm.events if e[0] == "load_weights"]
    assert len(loads) > workers and sum(n for _, n in loads) == workers * len(trainer.state_dict())
    for name, t in trainer.state_dict().items():
        torch.testing.assert_close(llm.hf.state_dict()[name], t)
    # and a second rollout after a sync samples from the new weights (the crash point)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(2.0)
    engine.sync_weights(trainer)
    flat = [c for g in engine.generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=5)) for c in g]
    torch.testing.assert_close(teacher_forced(trainer, tok, flat)[0, :len(flat[0].token_ids)],
                               torch.tensor(flat[0].logprobs), atol=2e-4, rtol=0)


def test_a_worker_that_loads_less_than_sent_is_an_error(tiny_llama, monkeypatch):
    engine, llm, _ = make_engine(tiny_llama, in_process=False)
    monkeypatch.setattr(llm, "_workers", [])  # no worker answered
    real = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc", lambda *a, **k: real(*a, **k) + [0])
    with pytest.raises(RuntimeError, match=r"vLLM workers loaded \[0\] of \d+ weight tensors"):
        engine.load_weights(copy.deepcopy(llm.hf))


def test_eos_at_the_length_cap_reaches_the_trainer_as_stop(tiny_llama):
    # vLLM 0.10.2: an EOS sampled as the last allowed token comes back as "length"
    engine, llm, tok = make_engine(tiny_llama, seed=4, length_before_stop=True, eos_on_last_step=True)
    flat = [c for g in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4)) for c in g]
    assert len(flat) == 6
    for c in flat:
        assert c.token_ids[-1] == tok.eos_token_id and c.finish_reason == "stop", c
    # the rule keeps a genuinely truncated response "length"
    engine, llm, tok = make_engine(tiny_llama, seed=4, length_before_stop=True)
    for c in [c for g in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4)) for c in g]:
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == tok.eos_token_id)


def test_default_records_the_sampling_distributions_logprobs(tiny_llama, monkeypatch):
    """A node that leaves rollout.vllm alone and samples at temperature 0.7 gets the log-probs
    of the tempered distribution its responses came from (not raw, biased ones)."""
    assert VllmSection().logprobs_mode == "processed_logprobs"
    monkeypatch.setattr(vb, "import_vllm", lambda: fake_vllm_module(FakeLLM))
    monkeypatch.setattr(vb, "require_cuda", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    engine = vb.build_vllm_engine(str(tiny_llama), tok, trainer, VllmSection(), seed=3, add_special_tokens=False)
    assert engine.llm.kwargs["logprobs_mode"] == "processed_logprobs"
    flat = [c for g in engine.generate(PROMPTS[:2], SamplingParams(n=2, temperature=0.7, max_new_tokens=6))
            for c in g]
    fwd = teacher_forced(trainer, tok, flat, temperature=0.7)
    for i, c in enumerate(flat):
        torch.testing.assert_close(fwd[i, :len(c.token_ids)], torch.tensor(c.logprobs), atol=2e-4, rtol=0)


def test_engine_model_access_paths(tiny_llama):
    _, llm, _ = make_engine(tiny_llama)
    kind, model = vb._engine_model(llm)
    assert kind == "local" and model is llm.vllm_model
    v1_inproc = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))))))
    assert vb._engine_model(v1_inproc) == ("local", model)
    with pytest.raises(RuntimeError, match="collective_rpc"):
        vb._engine_model(SimpleNamespace(llm_engine=None))


# ----- the trainer builds it ---------------------------------------------------------------------


def test_trainer_with_backend_vllm_builds_and_uses_the_engine(tiny_llama, prompt_file, tmp_path, monkeypatch):
    from tests.trainer.test_grpo import make_cfg

    from graft_fed.trainer.grpo import GRPOTrainer

    built = []

    class RecordingLLM(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            built.append(self)

    monkeypatch.setattr(vb, "import_vllm", lambda: fake_vllm_module(RecordingLLM))
    monkeypatch.setattr(vb, "require_cuda", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    cfg = make_cfg(tiny_llama, prompt_file, tmp_path / "run", **{"rollout.backend": "vllm",
                                                                   "rollout.vllm": {"gpu_memory_utilization": 0.4}})
    with GRPOTrainer(cfg, quiet=True) as tr:
        assert isinstance(tr.engine, vb.VLLMRollout)
        (llm,) = built
        assert llm.kwargs["model"] == str(tiny_llama) and llm.kwargs["gpu_memory_utilization"] == 0.4
        assert llm.kwargs["seed"] == 7 and llm.kwargs["enable_sleep_mode"] is True
        row = tr.train_step()
        assert tr.engine.pending is tr.model  # synced lazily before the next rollout
        tr.train_step()
    assert row["completions/mean_length"] > 0
    assert [e[0] for e in llm.events].count("load_weights") == 1


# ----- the real thing (needs vllm and a CUDA GPU) -----------------------------------------------


@pytest.mark.gpu
def test_real_vllm_logprobs_match_transformers_and_follow_weight_sync():
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from graft_fed.modeling import load_model_and_tokenizer
    from graft_fed.zoo import resolve_model_path

    path = resolve_model_path("zoo:tiny-llama-char")
    model, tok = load_model_and_tokenizer(path, torch.device("cuda"))
    opts = VllmSection(gpu_memory_utilization=0.2, dtype="fp32", enforce_eager=True, max_model_len=256)
    engine = vb.build_vllm_engine(path, tok, model, opts, seed=0, add_special_tokens=False,
                                  device=torch.device("cuda"))
    sp = SamplingParams(n=4, max_new_tokens=48)
    prompts = ["Q: What is 12 + 7?\nA: ", "Q: What is 3 * 4?\nA: "]

    def check(policy):
        flat = [c for g in engine.generate(prompts, sp) for c in g]
        assert len(flat) == 8 and all(c.finish_reason in ("stop", "length") for c in flat)
        for c in flat:
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in engine.eos_ids
            else:
                assert len(c.token_ids) == sp.max_new_tokens
        batch = pack([c.prompt_token_ids for c in flat], [c.token_ids for c in flat], tok.pad_token_id, "cuda")
        with torch.no_grad():
            want = response_forward(policy, batch).logprobs.cpu()
        for i, c in enumerate(flat):
            torch.testing.assert_close(torch.tensor(c.logprobs), want[i, :len(c.token_ids)], atol=2e-3, rtol=0)

    check(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    engine.sync_weights(model)
    check(model)  # the engine now samples from the changed weights
