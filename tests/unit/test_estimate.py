"""``litft estimate`` against what real steps hold, the sharding arithmetic of each strategy, and its CLI."""

import json
from pathlib import Path

import pytest
import torch

from litft.config import DeepSpeedArgs, FSDPArgs, Layout, LoraArgs, TrainArgs
from litft.objectives import next_token
from litft.estimate import render
from litft.estimate.states import memory_layout
from litft.estimate.memory import GiB, Param
from litft.parallel.strategies import SingleDevice, strategy_class

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config_hub" / "models" / "llama-3.2-1b"


# ---------------------------------------------------------------- sharding arithmetic, on made-up tensors

# Two blocks, tied embeddings in the root unit, one frozen tensor; every dim 0 divisible by 8.
TENSORS = [
    Param("embed", (1024, 64), 4, True, "root"),
    Param("block.0.w", (256, 64), 4, True, "block.0"),
    Param("block.0.frozen", (128, 64), 4, False, "block.0"),
    Param("block.1.w", (256, 64), 4, True, "block.1"),
]
ALL = sum(t.nbytes for t in TENSORS)
TRAINED = sum(t.nbytes for t in TENSORS if t.trainable)


def states(strategy="auto", devices=1, num_nodes=1, fsdp=FSDPArgs(), deepspeed=DeepSpeedArgs(), tensors=TENSORS, precision="32-true"):
    layout = Layout(strategy, devices, num_nodes, fsdp, deepspeed)
    train = TrainArgs(global_batch_size=layout.world_size, micro_batch_size=1)
    got = memory_layout(strategy_class(layout), tensors, layout, precision, train)
    return got, {name: row for name, row in got.buffers}


def test_one_process_and_ddp_hold_everything():
    single, buffers = states()
    assert (single.params.gpu, single.grads.gpu) == (ALL, TRAINED)
    assert single.optimizer.gpu == 2 * TRAINED + 4 * 3 and not buffers  # exp_avg, exp_avg_sq, a 4-byte step per tensor
    ddp, buffers = states("ddp", devices=4)
    assert (ddp.params.gpu, ddp.grads.gpu, ddp.optimizer.gpu) == (ALL, TRAINED, single.optimizer.gpu)
    assert buffers["DDP gradient buckets"].gpu == TRAINED


@pytest.mark.parametrize(
    "kind, devices, nodes, shard",
    [("FULL_SHARD", 8, 1, 8), ("SHARD_GRAD_OP", 4, 2, 8), ("HYBRID_SHARD", 4, 2, 4), ("NO_SHARD", 4, 2, 1)],
)
def test_fsdp_shards_over_its_shard_group(kind, devices, nodes, shard):
    got, buffers = states("fsdp", devices, nodes, FSDPArgs(sharding_strategy=kind))
    assert got.params.gpu == ALL / shard and got.grads.gpu == TRAINED / shard
    assert got.optimizer.gpu == 2 * TRAINED / shard + 4 * 3
    blocks = {u: sum(t.nbytes for t in TENSORS if t.unit == u) for u in ("block.0", "block.1")}
    root = TENSORS[0].nbytes
    gathered = root + sum(blocks.values())  # SHARD_GRAD_OP keeps both; else the one in use and the next, prefetched
    assert buffers["FSDP all-gathered parameters"].gpu == gathered
    # The largest trained unit (the root's embedding): its gradients, reduce-scatter input and the reduced shard accumulation adds in.
    assert buffers["FSDP reduce-scatter"].gpu == 1024 * 64 * (4 + 4 + 4 / shard)


def test_fsdp_rank_zero_takes_the_larger_chunk_and_4bit_weights_stay_whole():
    odd = [Param("w", (10, 3), 4, True, "block.0"), Param("q", (64, 64), 0.5, False, "block.0", quantized=True, quant_state=300)]
    got, _ = states("fsdp", 4, 1, FSDPArgs(sharding_strategy="FULL_SHARD"), tensors=odd)
    assert got.params.gpu == 3 * 3 * 4 + 64 * 64 / 2 + 300  # ceil(10 / 4) rows of w; q ignored by FSDP


def test_fsdp_cpu_offload_moves_the_shards_to_cpu():
    got, _ = states("fsdp", 8, 1, FSDPArgs(sharding_strategy="FULL_SHARD", cpu_offload=True))
    assert got.params.gpu == got.grads.gpu == got.optimizer.gpu == 0
    assert (got.params.cpu, got.grads.cpu) == (ALL / 8, TRAINED / 8)


@pytest.mark.parametrize(
    "stage, params, grads",
    [(0, ALL, TRAINED), (1, ALL, TRAINED), (2, ALL, TRAINED / 4), (3, ALL / 4, TRAINED / 4)],
)
def test_zero_stages_partition_more_and_more(stage, params, grads):
    got, buffers = states("deepspeed", 4, 1, deepspeed=DeepSpeedArgs(stage=stage))
    elements = TRAINED // 4
    assert (got.params.gpu, got.grads.gpu) == (params, grads)
    # Stage 0 runs the client AdamW on whole fp32 gradients; from stage 1 on, an fp32 master partition joins Adam's two states.
    assert got.optimizer.gpu == (2 * TRAINED + 4 * 3 if stage == 0 else 12 * elements / 4 + 4)
    assert ("DeepSpeed reduce bucket" in buffers) == (stage > 0)


def test_zero_offload_moves_bytes_to_the_cpu_column():
    on_gpu, _ = states("deepspeed", 4, 1, deepspeed=DeepSpeedArgs(stage=3))
    got, _ = states("deepspeed", 4, 1, deepspeed=DeepSpeedArgs(stage=3, offload_optimizer="cpu", offload_parameters="cpu"))
    assert got.params.gpu == got.grads.gpu == got.optimizer.gpu == 0
    assert (got.params.cpu, got.optimizer.cpu) == (on_gpu.params.gpu, on_gpu.optimizer.gpu)
    assert got.grads.cpu == 4 * (TRAINED // 4) / 4  # the fp32 gradient partition beside the optimizer


# ---------------------------------------------------------------- against a real step, in this process


@pytest.mark.parametrize("quantize, precision", [(None, "32-true"), ("bnb.nf4-dq", "32-true"), (None, "bf16-mixed")])
def test_model_states_match_a_real_step(tiny_dir, quantize, precision):
    """The job's own module (build.build_module), one step, then the strategy's state_bytes: trained adapters
    beside a frozen (or 4-bit, or bf16 under bf16-mixed) base. Full finetunes and two-rank layouts are checked
    against real runs' logs by benchmarks/estimate_check.py."""
    from litft.run.build import build_model, build_module
    from litft.estimate.inventory import model_tensors
    from litft.model.loading import load_config

    lora = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules="all-linear", quantize=quantize)
    strategy = SingleDevice(Layout(), "cpu", precision, TrainArgs())
    lm, fill, _ = build_module(
        str(tiny_dir), precision, lora, TrainArgs(), 1, random_init=False, seed=0, device=torch.device("cpu"), strategy=strategy
    )
    fill(lm)
    tokens = torch.randint(0, 300, (2, 16))
    optimizer = lm.configure_optimizers()["optimizer"]
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = lm.training_step({"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(16).expand(2, -1)})
    loss.backward()
    optimizer.step()
    held = strategy.state_bytes(lm, optimizer)

    frozen_dtype = SingleDevice.frozen_base_dtype(precision)
    tensors = model_tensors(build_model(load_config(str(tiny_dir)), precision, lora, False, frozen_dtype=frozen_dtype), quantize)
    got = memory_layout(SingleDevice, tensors, Layout(), precision, TrainArgs())
    quant_state = sum(t.quant_state for t in tensors)
    assert got.params.gpu - quant_state == held["params"]
    assert (got.grads.gpu, got.optimizer.gpu) == (held["grads"], held["optimizer"])
    if quantize:  # bitsandbytes' absmax, nested absmax and codes beside the packed weights, as it saves them
        states_ = [p.quant_state.as_dict(packed=False) for p in lm.parameters() if type(p).__name__ == "Params4bit"]
        held = sum(v.numel() * v.element_size() for s in states_ for v in s.values() if torch.is_tensor(v))
        assert quant_state == held + 4 * len(states_)  # + the fp32 offset of each nested state (saved as a float)


def test_saved_activations_match_saved_tensors_hooks():
    """What the fake-tensor trace (1 and 2 blocks, extrapolated to 4) says the forward keeps for backward,
    against the storages autograd hands to saved_tensors_hooks in a real 4-block step: LoRA (dropout
    copies, fp32 adapters) under bf16 autocast (cached weight casts), the fp32 loss over the vocabulary.
    The peak over the whole step, with and without checkpointing, is checked by benchmarks/estimate_check.py."""
    from transformers import LlamaConfig

    from benchmarks.activation_probe import measure_step
    from litft.run.build import build_model
    from litft.estimate.trace import trace_activations
    from litft.model.causal_lm import CausalLM
    from litft.model.weights import Materializer

    config = LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    build = dict(
        precision="bf16-mixed", lora=LoraArgs(r=4, alpha=8, dropout=0.05, target_modules="all-linear"), frozen_dtype=torch.bfloat16
    )
    lm = CausalLM(build_model(config, **build, gradient_checkpointing=False), TrainArgs(), next_token())
    Materializer(lm.model, lm.hf_model, None, seed=0)(lm)
    lm.train()
    tokens = torch.randint(0, 384, (2, 128))
    batch = {"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(128).expand(2, -1)}
    measured = measure_step(lm, batch, torch.bfloat16, peak=False)
    params_dtype, autocast = SingleDevice.compute_view(Layout(), "bf16-mixed")
    estimated = trace_activations(config, dict(build, gradient_checkpointing=False), params_dtype, autocast, 2, 128)
    assert abs(estimated.saved - measured["saved"]) <= 0.05 * measured["saved"], (estimated, measured)
    assert estimated.per_layer > 0 and estimated.peak > estimated.saved


# ---------------------------------------------------------------- the command


def run_main(args, capsys):
    from litft.__main__ import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="config_hub/models not there")
def test_cli_estimates_a_shipped_config(capsys):
    code, out, _ = run_main(
        ["estimate", SHIPPED, "--job", "finetune_full", "--strategy", "fsdp", "--devices", "8", "--fsdp.sharding_strategy", "FULL_SHARD",
         "--seq_len", "64", "--json", "true"],
        capsys,
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["parameters"]["total"] == plan["parameters"]["trained"] == 1_235_814_400
    assert plan["strategy"] == "FSDP FULL_SHARD" and plan["world_size"] == 8
    rank, shard = plan["per_rank"], 4 * 1_235_814_400 / 8  # bf16-mixed keeps fp32 weights, sharded 8 ways
    for component, per_param in (("params", 1), ("grads", 1), ("optimizer", 2)):
        assert abs(rank[component]["gpu"] - per_param * shard) < 0.01 * shard, component
    assert plan["fits"] and plan["total"]["gpu"] < 10 * GiB
    table = render(plan)
    assert "FSDP all-gathered parameters" in table and "fits" in table


def test_tensor_parallel_splits_the_blocks_before_fsdp_shards_them(tiny_dir):
    """Per rank: a split layer's tensors 1/(tp x shard), the rest 1/shard, as test_sharding's tensor-parallel run measures
    them; the heads' and MLP's activations shrink, the hidden states between blocks stay whole."""
    from litft.run.build import build_model
    from litft.estimate import memory_plan
    from litft.model.loading import load_config
    from litft.parallel.tensor import split_over_tensor_parallel

    plans = {
        tp: memory_plan(
            model=str(tiny_dir), job="finetune_full", strategy="fsdp", fsdp=FSDPArgs("FULL_SHARD"), devices=4, tensor_parallel=tp,
            precision="32-true", seq_len=256,
        )
        for tp in (1, 2)
    }
    tensors = dict(build_model(load_config(str(tiny_dir)), "32-true", None, False).named_parameters())
    held = sum(4 * p.numel() / (4 if split_over_tensor_parallel(name) else 2) for name, p in tensors.items())
    assert plans[2]["per_rank"]["params"]["gpu"] == held == plans[2]["per_rank"]["grads"]["gpu"]
    assert plans[2]["tensor_parallel"] == 2 and "blocks split over 2 ranks" in render(plans[2])
    assert plans[2]["activations"]["per_layer"] < plans[1]["activations"]["per_layer"]


def test_expert_parallel_gathers_a_ranks_experts_and_adds_the_dispatch():
    """Per rank: the same shards as FSDP alone (1/N of the experts over 1/N as many ranks), but a block gathers 1/N of its
    experts; each MoE layer's (token, expert) rows are sent and received; the active parameters are the top-k experts'."""
    from litft.estimate import memory_plan

    plans = {
        ep: memory_plan(model="litft-tiny-moe", job="finetune_full", strategy="fsdp", fsdp=FSDPArgs("FULL_SHARD"), devices=4, expert_parallel=ep,
                        precision="32-true", seq_len=256)
        for ep in (1, 4)
    }
    one, four = plans[1], plans[4]
    assert four["per_rank"]["params"]["gpu"] == one["per_rank"]["params"]["gpu"] and "experts dealt out 1/4" in four["per_rank"]["params"]["note"]
    # litft-tiny-moe: hidden 128, 8 experts of width 96 (gate, up, down), 4 layers; two blocks are gathered at a time.
    experts_per_block = 8 * 3 * 128 * 96 * 4
    gathered = lambda plan: plan["per_rank"]["buffers"]["FSDP all-gathered parameters"]["gpu"]  # noqa: E731
    assert gathered(one) - gathered(four) == 2 * experts_per_block * 3 / 4
    assert "expert dispatch (all-to-all)" not in one["per_rank"]["buffers"]
    assert four["per_rank"]["buffers"]["expert dispatch (all-to-all)"]["gpu"] == 2 * 256 * 2 * 128 * 4
    assert four["experts"]["per_rank"] == 2 and one["experts"]["per_rank"] == 8
    assert four["experts"]["active_parameters"] == four["parameters"]["total"] - 4 * experts_per_block // 4 * 6 // 8
    assert "experts: 2 of 8 per MoE layer on each rank (dealt out over 4 ranks), 2 per token" in render(four)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "fsdp", "--fsdp.sharding_strategy", "FULL_SHARD", "--fsdp.shard_size", "2"], "only applies to HYBRID_SHARD"),
        (["--strategy", "fsdp", "--devices", "2", "--expert_parallel", "2"], "--expert_parallel deals out MoE experts, and llama has none"),
        (["--job", "finetune_full", "--quantize", "bnb.nf4"], "--quantize trains 4-bit weights only through LoRA adapters"),
        (["--strategy", "deepspeed", "--deepspeed.offload_parameters", "cpu"], "offload_parameters needs --deepspeed.stage 3"),
        (["--strategy", "fsdp", "--gpu", "V100"], "fp16 needs loss scaling that FSDP2 lacks"),
        (["--gpu", "TPUv9"], "--gpu TPUv9 is unknown"),
        (["--devices", "3", "--context_parallel", "3"], "--context_parallel 3 must divide the model's 4 attention heads"),
        (["--strategy", "fsdp", "--devices", "4", "--tensor_parallel", "4"], "--tensor_parallel 4 must divide the model's 2 key/value heads"),
        (["--strategy", "deepspeed", "--devices", "2", "--tensor_parallel", "2"], "DeepSpeed cannot hold them, use --strategy fsdp"),
    ],
)
def test_impossible_runs_are_refused_in_one_line(capsys, tiny_dir, args, message):
    code, _, err = run_main(["estimate", tiny_dir, *args], capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_unreachable_hub_id_is_one_line(capsys):
    code, _, err = run_main(["estimate", "meta-llama/Llama-3.1-8B"], capsys)
    assert code == 2 and "could not load 'meta-llama/Llama-3.1-8B'" in err and len(err.splitlines()) == 1, err


def test_offloaded_bytes_match_a_real_offloaded_step_and_leave_the_device(tiny_dir):
    """The trace's host bytes under activation offload equal what a real step copies out (the same 64 KiB floor as on a GPU,
    each block rounded up to a power of two as torch's pinned-memory cache does), and with checkpointing the device keeps no block's input: a block adds nothing to what the forward leaves."""
    import functools

    from litft.estimate.trace import trace_activations
    from litft.model.loading import load_config
    from litft.model.offload import MIN_BYTES_CUDA, ActivationOffload
    from litft.run.build import build_module

    train = TrainArgs(activation_offload=True, gradient_checkpointing=True)
    lm, fill, _ = build_module(str(tiny_dir), "32-true", None, train, 1, random_init=False, seed=0, device=torch.device("cpu"),
                               strategy=SingleDevice(Layout(), "cpu", "32-true", train))
    fill(lm)
    lm.train()
    lm.offload_kind = functools.partial(ActivationOffload, min_bytes=MIN_BYTES_CUDA, pinned_sizes=True)
    tokens = torch.randint(5, 300, (2, 256), generator=torch.Generator().manual_seed(0))
    lm.training_step({"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(256).expand(2, -1)}).backward()
    config = load_config(str(tiny_dir))
    build = dict(precision="32-true", lora=None, gradient_checkpointing=True)
    traced = trace_activations(config, build, lambda p: torch.float32, None, 2, 256, offload=True)
    assert lm.offloaded_bytes > 0 and traced.offloaded == lm.offloaded_bytes
    plain = trace_activations(config, build, lambda p: torch.float32, None, 2, 256)
    assert traced.per_layer == 0 < plain.per_layer and traced.peak < plain.peak


@pytest.mark.parametrize("power", [1, 2], ids=["linear", "quadratic"])
def test_longest_search_finds_the_limit_within_one_percent(power):
    """The search on a memory curve like the estimate's (fixed costs, then linear; quadratic as under eager attention):
    the answer fits, 1% more does not, in a handful of traces."""
    from litft.estimate.plan import search_longest

    usable, calls = 80e9, []

    def over(seq):
        calls.append(seq)
        return 20e9 + 3e4 * seq + (2e-2 * seq ** 2 if power == 2 else 0) - usable, usable

    found = search_longest(over, 2048)
    assert over(found)[0] <= 0 < over(found + max(64, found // 100))[0] and len(calls) <= 10, (found, calls)
    assert search_longest(lambda seq: (1.0, usable), 2048) == 0  # nothing fits


def test_cli_longest_is_refused_under_grpo(capsys, tiny_dir):
    code, _, err = run_main(["estimate", tiny_dir, "--objective", "grpo", "--longest", "true"], capsys)
    assert code != 0 and "--longest searches a training sequence" in err
