"""vLLM rollout backend: the same `RolloutEngine` protocol as the transformers backend,
for real models on GPUs.

The engine is colocated with the trainer on the same GPU(s):

* it takes `gpu_memory_utilization` of the GPU for its weights and KV cache, and with
  `sleep` it offloads its weights to CPU memory and frees its KV cache after every
  rollout (vLLM sleep mode, level 1), so the trainer has the GPU while it trains;
* `sync_weights(model)` marks the engine stale; the next `generate()` empties PyTorch's
  CUDA cache (memory the trainer freed is otherwise still held by PyTorch's allocator and
  vLLM cannot take it back), wakes the weights only, streams the trainer's current
  parameters into the engine's model (no disk: in-process, or as pickled payloads through
  vLLM's RPC, see `_engine_model` and `encode_weight_chunk`), resets the prefix cache,
  empties the cache again and only then wakes the KV cache, so the copy never coexists
  with a full KV cache;
* prompts go in as the trained model's token ids (the tokenisation the trainer uses; vLLM
  never loads a tokenizer, `skip_tokenizer_init`), and every response comes back as a
  `Completion` with the same fields as the transformers backend: token ids including the
  final EOS when it stopped, the log-prob of every sampled token, the text decoded by the
  same tokenizer, "stop" or "length" (an EOS sampled as the last allowed token is "stop",
  whatever the vLLM release reports, see `finish_reason`).

The log-probs are what vLLM reports for the sampled token (`logprobs=0`) under its
`logprobs_mode`: "processed_logprobs" (default) are those of the distribution after
temperature and top-k/top-p, what the transformers backend records; "raw_logprobs" are the
untempered full-vocabulary model's. Both are equal at temperature 1, top_p 1, top_k 0 (the
paper's setting). Any other sampling setting logs a warning saying which way the recorded
log-probs are off.

vllm is imported only when an engine is built (extra `vllm`); everything else in this
module is plain Python so that the conversion logic is tested on CPU with fakes.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import logging
import os
import pickle
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from graft_fed.errors import ConfigError
from graft_fed.modeling import eos_token_ids
from graft_fed.rollout.base import Completion, SamplingParams

log = logging.getLogger("graft_fed.rollout.vllm")

#: Weight tensors sent to a vLLM worker per RPC when the engine lives in another process.
RPC_CHUNK_BYTES = 512 * 2**20
#: vLLM 0.33 rejects a higher sampling temperature (and it is no setting for RL anyway).
MAX_TEMPERATURE = 2.0

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Module names that wrappers (torch.compile, FSDP1, activation checkpointing) insert into
# parameter names; vLLM's load_weights expects the plain Hugging Face checkpoint names.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

INSTALL_HINT = ("rollout.backend 'vllm' needs the vllm package, which is not installed: "
                "pip install 'graft-fed[vllm]' on a machine with a CUDA GPU (vLLM does not run on CPU), "
                "or use rollout.backend: hf")


def import_vllm() -> Any:
    """The vllm module, or a ConfigError saying how to get it."""
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT} (import failed: {exc})") from None
    return vllm


def require_cuda(device: torch.device | None = None) -> None:
    if not torch.cuda.is_available():
        raise ConfigError("rollout.backend 'vllm' needs a CUDA GPU and none is visible to torch; "
                          "use rollout.backend: hf on this machine")
    if device is not None and (device.type != "cuda" or device.index not in (None, 0)):
        raise ConfigError(f"rollout.backend 'vllm' shares the GPU with the trainer, which is on {device}; "
                          "train on 'cuda' (or 'auto') and choose the GPU with CUDA_VISIBLE_DEVICES")


# ----- pure conversion logic (tested everywhere) --------------------------------------------


def engine_kwargs(model_path: str, opts: Any, seed: int, bf16_supported: bool) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for a colocated engine (`opts`: a VllmSection)."""
    dtype = _DTYPES.get(opts.dtype) or ("bfloat16" if bf16_supported else "float16")
    kwargs: dict[str, Any] = {
        "model": model_path,
        # Prompts go in as token ids and graft-fed decodes the responses, so vLLM needs no
        # tokenizer; loading one would fail for tokenizers whose class vLLM's pinned
        # transformers lacks (the zoo's name a transformers-5-only class).
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "seed": seed,
        "gpu_memory_utilization": opts.gpu_memory_utilization,
        "tensor_parallel_size": opts.tensor_parallel_size,
        "enable_sleep_mode": opts.sleep,
        "enforce_eager": opts.enforce_eager,
        "enable_prefix_caching": opts.enable_prefix_caching,
        "logprobs_mode": opts.logprobs_mode,
    }
    if opts.max_model_len is not None:
        kwargs["max_model_len"] = opts.max_model_len
    return kwargs


def sampling_kwargs(sp: SamplingParams, seed: int, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one prompt's group of `sp.n` responses.

    Only the sampled token's log-prob is asked for (logprobs=0). EOS handling is explicit:
    generation stops at any of `stop_token_ids` (the tokenizer's and the generation
    config's EOS ids, as the transformers backend) and the stop token stays in the
    response's token ids. Text is decoded by graft-fed's tokenizer, not by vLLM.
    """
    if not 0 < sp.temperature <= MAX_TEMPERATURE:
        raise ConfigError(f"rollout.temperature is {sp.temperature}, but the vLLM backend samples only with a "
                          f"temperature in (0, {MAX_TEMPERATURE:g}] (vLLM 0.33 rejects higher ones); set "
                          "rollout.temperature in that range or use rollout.backend: hf")
    return {
        "n": sp.n,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,  # -1 = off in every vLLM release
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": sp.max_new_tokens,
        "seed": seed,
        "logprobs": 0,
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": False,
        "detokenize": False,
    }


def logprob_bias_warning(sp: SamplingParams, logprobs_mode: str) -> str | None:
    """Why the recorded log-probs are not the untempered policy's, or None when they are."""
    changed = []
    if sp.temperature != 1.0:
        changed.append(f"temperature {sp.temperature}")
    if sp.top_p < 1.0:
        changed.append(f"top_p {sp.top_p}")
    if sp.top_k > 0:
        changed.append(f"top_k {sp.top_k}")
    if not changed:
        return None
    what = ", ".join(changed)
    if logprobs_mode == "raw_logprobs":
        return (f"vLLM samples with {what} but records raw log-probs (the untempered, full-vocabulary model): "
                "they are not the log-probs of the distribution the responses were drawn from, so importance "
                "ratios and GRAFT compatibility scores computed from them are biased. Train with temperature 1, "
                "top_p 1, top_k 0 (the paper's setting), or set rollout.vllm.logprobs_mode: processed_logprobs")
    truncated = sp.top_p < 1.0 or sp.top_k > 0
    return (f"vLLM samples with {what} and records processed log-probs: they are those of the "
            f"{'truncated, ' if truncated else ''}tempered sampling distribution, not of the untempered policy"
            + ("; ratios and GRAFT compatibility scores against full-vocabulary log-probs are biased "
               "(the paper trains with top_p 1)" if truncated else ""))


def request_seed(base_seed: int, call: int, index: int) -> int:
    """A per-request sampling seed: a hash of (run seed, generate call, prompt index), so a
    run resumed at the same call draws the same samples."""
    digest = hashlib.blake2b(f"{base_seed}:{call}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def sampled_logprobs(entries: Any, token_ids: Sequence[int]) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position log-prob entries.

    Each entry maps token id -> `Logprob` (with `.logprob`) or a float; vLLM's flat
    container (`FlatLogprobs`) gives the same mapping per position when indexed.
    """
    if entries is None:
        raise RuntimeError("vLLM returned no log-probs for a response; the request must set logprobs=0 "
                           "(graft_fed.rollout.vllm.sampling_kwargs does)")
    if len(entries) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(entries)} log-prob entries for {len(token_ids)} tokens")
    out: list[float] = []
    for pos, tok in enumerate(token_ids):
        entry = entries[pos]
        item = entry.get(tok) if isinstance(entry, Mapping) else None
        if item is None:
            raise RuntimeError(f"vLLM's log-probs at response position {pos} do not include the sampled token {tok}")
        out.append(float(getattr(item, "logprob", item)))
    return out


def finish_reason(reason: Any, token_ids: Sequence[int], stop_token_ids: Sequence[int]) -> str:
    """"stop" when the response ends in a stop token, else "length", checked against vLLM's report.

    vLLM 0.10.2 tests the length cap before the stop tokens, so an EOS sampled as the last
    allowed token is reported as "length" (later releases and the transformers backend say
    "stop"). The token ids decide: a response that ends in EOS finished, whatever the cap.
    """
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a response with finish_reason {reason!r} (expected 'stop' at an EOS or "
                           "'length' at max_new_tokens / max_model_len); was the request aborted?")
    if reason == "length" and token_ids and int(token_ids[-1]) in {int(t) for t in stop_token_ids}:
        return "stop"
    return reason


def completion_from_output(output: Any, prompt_ids: Sequence[int], decode: Callable[[list[int]], str],
                           stop_token_ids: Sequence[int] = ()) -> Completion:
    """One vLLM `CompletionOutput` as a `Completion` (same fields as the transformers backend);
    `stop_token_ids` are the ids the request stopped at (see `finish_reason`)."""
    token_ids = [int(t) for t in output.token_ids]
    reason = finish_reason(output.finish_reason, token_ids, stop_token_ids)
    return Completion(text=decode(token_ids), token_ids=token_ids,
                      logprobs=sampled_logprobs(output.logprobs, token_ids),
                      finish_reason=reason, prompt_token_ids=list(prompt_ids))


def group_from_request_output(request_output: Any, prompt_ids: Sequence[int], n: int,
                              decode: Callable[[list[int]], str],
                              stop_token_ids: Sequence[int] = ()) -> list[Completion]:
    """The `n` completions of one prompt, in vLLM's sample order."""
    outputs = sorted(request_output.outputs, key=lambda o: getattr(o, "index", 0))
    if len(outputs) != n:
        raise RuntimeError(f"vLLM returned {len(outputs)} responses for a prompt; asked for n={n}")
    return [completion_from_output(o, prompt_ids, decode, stop_token_ids) for o in outputs]


def vllm_weight_name(name: str) -> str:
    """A trainer parameter name as vLLM's load_weights expects it (the Hugging Face
    checkpoint name): wrapper components and a leading DDP `module.` removed."""
    if name.startswith("module."):
        name = name[len("module."):]
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def iter_weights(model: Any, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every entry of `model`'s state dict, one at a time:
    a sharded tensor (DTensor, e.g. FSDP2) is gathered, then cast to `dtype`, so at most
    one converted tensor exists at a time beyond the model itself."""
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield vllm_weight_name(name), tensor


def chunked(weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most `max_bytes` (a larger tensor travels alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


# ----- the one place that knows where a vLLM release keeps the model -----------------------


def _engine_model(llm: Any) -> tuple[str, Any]:
    """How to reach the engine's model: ("local", model) when the engine runs in this
    process (V0, or V1 with VLLM_ENABLE_V1_MULTIPROCESSING=0), else ("rpc", collective_rpc)
    to run a function on every worker (V1's default: the engine in its own process).

    This is the only version-dependent access in the module.
    """
    engine = getattr(llm, "llm_engine", None)
    executors = [getattr(engine, "model_executor", None)]
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # V1 in-process client
    executors.append(getattr(core, "model_executor", None))
    for executor in executors:
        worker = getattr(executor, "driver_worker", None)
        worker = getattr(worker, "worker", None) or worker  # WorkerWrapperBase -> Worker
        model = getattr(getattr(worker, "model_runner", None), "model", None)
        if callable(getattr(model, "load_weights", None)):
            return "local", model
    rpc = getattr(llm, "collective_rpc", None)
    if callable(rpc):
        return "rpc", rpc
    raise RuntimeError("cannot reach the vLLM engine's model to update its weights: this vLLM release has neither "
                       "an in-process driver worker nor LLM.collective_rpc; install a supported one "
                       "(pip install 'graft-fed[vllm]')")


# What crosses vLLM's RPC. vLLM encodes collective_rpc arguments with msgpack and decodes
# them without type hints: a tuple arrives as a list and a tensor as [dtype, shape, buffer],
# so neither a CUDA IPC handle (a tuple) nor a tensor survives the trip. Bytes do, unchanged,
# so each chunk travels as one pickled payload that the worker unpickles itself. The payload
# goes from this process to the engine process it started (vLLM already needs
# VLLM_ALLOW_INSECURE_SERIALIZATION for the function that unpickles it), never over a network.
_IPC, _CPU = "cuda_ipc", "cpu"


def _on_gpu(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda


def _ipc_handle(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple]:
    """(rebuild function, its arguments): what opens `tensor`'s CUDA memory in another process."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)


def encode_weight_chunk(chunk: Sequence[tuple[str, torch.Tensor]], same_gpu: bool) -> bytes:
    """One chunk of (name, tensor) as bytes for a worker: a CUDA IPC handle per tensor when
    the worker is on this GPU (tensor parallelism 1; nothing is copied), else a CPU copy
    (each worker of a tensor-parallel engine keeps its own shard of the full tensor)."""
    items = []
    for name, tensor in chunk:
        if same_gpu and _on_gpu(tensor):
            items.append((name, _IPC, _ipc_handle(tensor.contiguous())))
        else:
            buffer = io.BytesIO()
            torch.save(tensor.detach().cpu().contiguous(), buffer)
            items.append((name, _CPU, buffer.getvalue()))
    return pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)


def decode_weight_chunk(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an `encode_weight_chunk` payload, in the worker."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"a vLLM worker received a weight payload of type {type(payload).__name__}, expected the "
                        "bytes of graft_fed.rollout.vllm.encode_weight_chunk; send weights through collective_rpc "
                        "only as that payload (vLLM's RPC does not carry tuples or tensors intact)")
    out = []
    for name, kind, data in pickle.loads(bytes(payload)):
        if kind == _IPC:
            rebuild, args = data
            tensor = rebuild(*args)  # opens the trainer's CUDA memory in this process
        elif kind == _CPU:
            tensor = torch.load(io.BytesIO(data), weights_only=True)
        else:
            raise ValueError(f"unknown weight payload kind {kind!r} for {name}")
        out.append((name, tensor))
    return out


def _worker_model(worker: Any) -> Any:
    worker = getattr(worker, "worker", None) or worker
    return worker.model_runner.model


def _load_on_worker(worker: Any, payload: bytes) -> int:
    """Runs inside a vLLM worker: load one `encode_weight_chunk` payload. Returns how many
    tensors it loaded (a plain int, which any RPC carries back)."""
    weights = decode_weight_chunk(payload)
    _worker_model(worker).load_weights(weights=weights)
    if torch.cuda.is_available():
        # the trainer's tensors behind the IPC handles must be read before the call returns
        torch.cuda.synchronize()
    return len(weights)


def _wake_up(llm: Any, tags: Sequence[str]) -> set[str]:
    """Wake the given parts; releases without tags wake everything. Returns what woke."""
    if "tags" in inspect.signature(llm.wake_up).parameters:
        llm.wake_up(tags=list(tags))
        return set(tags)
    llm.wake_up()
    return {"weights", "kv_cache"}


# ----- the engine ------------------------------------------------------------------------------


class VLLMRollout:
    """Rollout engine over a colocated `vllm.LLM` (see the module docstring).

    `sampling_params_cls` is `vllm.SamplingParams`; tests pass fakes of `llm` and it.
    """

    def __init__(self, llm: Any, tokenizer: Any, sampling_params_cls: Any, *, seed: int = 0,
                 add_special_tokens: bool = False, eos_ids: Sequence[int] = (), sleep: bool = True,
                 logprobs_mode: str = "processed_logprobs", weight_dtype: torch.dtype | None = torch.bfloat16,
                 same_gpu: bool = True) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.sampling_params_cls = sampling_params_cls
        self.seed = seed
        self.add_special_tokens = add_special_tokens
        self.eos_ids = [int(t) for t in eos_ids]
        self.sleep = sleep
        self.logprobs_mode = logprobs_mode
        self.weight_dtype = weight_dtype
        self.same_gpu = same_gpu
        self.calls = 0
        self.asleep: set[str] = set()
        self.pending: Any = None  # the trainer model whose weights the next generate() loads
        self.timings: dict[str, float] = {}
        self._warned: set[str] = set()
        if sleep:
            self._sleep()

    # ----- protocol ----------------------------------------------------------------------------

    def sync_weights(self, model: Any) -> None:
        """The next generate() samples from `model`'s parameters as they are then (the trainer
        updates them in place; they are copied once, just before sampling)."""
        self.pending = model

    def rng_state(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def set_rng_state(self, state: Mapping[str, int]) -> None:
        self.seed = int(state["seed"])
        self.calls = int(state["calls"])

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=self.add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompts: Sequence[str], sampling: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[list[Completion]]:
        """`seeds` (one per prompt, as the transformers backend's keyed sampling) seed each
        prompt's request from its key alone; without it, from (run seed, call, position)."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        self._warn_bias(sampling)
        encoded = [self.encode(p) for p in prompts]
        keys = ([request_seed(int(s), -1, 0) for s in seeds] if seeds is not None
                else [request_seed(self.seed, self.calls, i) for i in range(len(encoded))])
        params = [self.sampling_params_cls(**sampling_kwargs(sampling, key, self.eos_ids)) for key in keys]
        self.calls += 1
        self.wake()
        try:
            t0 = time.perf_counter()
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], params, use_tqdm=False)
            self.timings["generate"] = time.perf_counter() - t0
        finally:
            if self.sleep:
                self._sleep()
        if len(outputs) != len(encoded):
            raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(encoded)} prompts")
        return [group_from_request_output(out, ids, sampling.n, self.decode, self.eos_ids)
                for out, ids in zip(outputs, encoded)]

    # ----- memory choreography ---------------------------------------------------------------

    def wake(self) -> None:
        """Weights first; load pending trainer weights; reset the prefix cache; then the KV cache.

        PyTorch's caching allocator keeps the memory the trainer freed (activations,
        gradients, the optimiser step's temporaries) reserved for the trainer; vLLM allocates
        outside it and cannot use that memory. So the cache is emptied before each wake-up,
        and again after the weight copy (its cast tensors), or the KV cache does not fit.
        """
        t0 = time.perf_counter()
        if self.pending is not None:
            if "weights" in self.asleep:
                torch.cuda.empty_cache()
                self.asleep -= _wake_up(self.llm, ["weights"])
            self.load_weights(self.pending)
            self.pending = None
        if self.asleep:
            torch.cuda.empty_cache()
            self.asleep -= _wake_up(self.llm, sorted(self.asleep))
        self.timings["wake"] = time.perf_counter() - t0

    def _sleep(self) -> None:
        t0 = time.perf_counter()
        self.llm.sleep(level=1)
        self.asleep = {"weights", "kv_cache"}
        self.timings["sleep"] = time.perf_counter() - t0

    def load_weights(self, model: Any) -> int:
        """Copy `model`'s parameters into the engine (no disk); returns the tensors sent."""
        t0 = time.perf_counter()
        kind, target = _engine_model(self.llm)
        weights = iter_weights(model, self.weight_dtype)
        sent = 0
        if kind == "local":
            counted = _counting(weights)  # streamed: one converted tensor at a time
            target.load_weights(weights=counted)
            sent = counted.count
        else:
            for chunk in chunked(weights, RPC_CHUNK_BYTES):
                loaded = target(_load_on_worker, args=(encode_weight_chunk(chunk, self.same_gpu),))
                # one count per worker; each must have loaded the whole chunk
                if any(int(n) != len(chunk) for n in loaded):
                    raise RuntimeError(f"vLLM workers loaded {list(loaded)} of {len(chunk)} weight tensors")
                sent += len(chunk)
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):
            reset()  # cached prefixes were computed with the old weights
        self.timings["weight_sync"] = time.perf_counter() - t0
        return sent

    def _warn_bias(self, sampling: SamplingParams) -> None:
        message = logprob_bias_warning(sampling, self.logprobs_mode)
        if message and message not in self._warned:
            self._warned.add(message)
            log.warning(message)


class _counting:
    """An iterator wrapper that counts what it yielded."""

    def __init__(self, items: Iterable[Any]) -> None:
        self._it = iter(items)
        self.count = 0

    def __iter__(self) -> "_counting":
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self.count += 1
        return item


def build_vllm_engine(model_path: str, tokenizer: Any, trainer_model: Any, opts: Any, *, seed: int,
                      add_special_tokens: bool, device: torch.device | None = None) -> VLLMRollout:
    """A colocated vLLM engine over the model at `model_path` (the directory the trainer
    loaded `trainer_model` from), configured by `opts` (a VllmSection)."""
    vllm = import_vllm()
    require_cuda(device)
    # Weight updates send our own functions to our own engine process (collective_rpc with
    # a callable); vLLM's V1 engine accepts them only with this set.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    kwargs = engine_kwargs(model_path, opts, seed, torch.cuda.is_bf16_supported())
    log.info("starting vLLM %s for %s: %s", getattr(vllm, "__version__", "?"), model_path,
             {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")})
    llm = vllm.LLM(**kwargs)
    return VLLMRollout(llm, tokenizer, vllm.SamplingParams, seed=seed, add_special_tokens=add_special_tokens,
                       eos_ids=eos_token_ids(tokenizer, trainer_model), sleep=opts.sleep,
                       logprobs_mode=opts.logprobs_mode, weight_dtype=_TORCH_DTYPES[kwargs["dtype"]],
                       same_gpu=opts.tensor_parallel_size == 1)
