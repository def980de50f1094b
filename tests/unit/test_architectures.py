"""Every architecture litft accepts trains as transformers computes it: loss and gradients against the model's own eager forward.

Each tiny model (tests/architectures.py) is saved as ``save_pretrained`` saves it,
then built as the jobs build it (meta device, litft's fill from the checkpoint,
litft_segments attention, the fused head where it is exact) and run on packed
and on padded batches; the reference is transformers' ``from_pretrained`` with
eager attention, one sample at a time. Architectures litft does not train are
refused in one line.
"""

import shutil

import pytest
import torch

from litft.model import attention
from litft.model.varlen import VarlenKernel, use_varlen_kernel
from litft.data.collate import collate
from litft.data.samples import pack
from litft.errors import LitftError
from litft.model.loading import check_architecture, load_config, own_mask_layers
from litft.model.recurrent import carries_state
from tests.architectures import ARCHITECTURES, COMMON, VOCAB, as_litft_builds_it, reference, samples, save_tiny
from tests.varlen_standins import STANDINS

TRAINED = [a for a in ARCHITECTURES if a.refused is None]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return {a.name: save_tiny(a, root / a.name.split()[0]) for a in ARCHITECTURES}


@pytest.fixture(scope="module")
def references(folders):
    return {a.name: reference(folders[a.name]) for a in TRAINED}


@pytest.mark.parametrize("architecture", TRAINED, ids=[a.name for a in TRAINED])
def test_loss_and_gradients_equal_transformers_eager(architecture, folders, references):
    """Packed (padding-free) and padded batches: the summed loss to 1e-5 and every gradient to 1e-4 (relative L2). Models whose
    layers carry state (litft.model.recurrent) or attend within chunks train on padded rows only."""
    expected, expected_grads = references[architecture.name]
    for padding_free in (False,) if carries_state(architecture.build()) or own_mask_layers(architecture.build()) else (True, False):
        lm = as_litft_builds_it(folders[architecture.name])
        batch = collate(pack(samples(), max_length=64), pad_id=0, padding_free=True) if padding_free else collate(samples(), pad_id=0)
        loss = lm.loss_sum(batch)
        loss.backward()
        where = "padding-free" if padding_free else "padded"
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), f"{where}: loss {loss.item()} vs {expected.item()}"
        grads = {n: p.grad for n, p in lm.hf_model.named_parameters() if p.grad is not None}
        assert grads.keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            error = (grads[name] - grad).norm() / grad.norm().clamp(min=1e-12)
            assert error <= 1e-4, f"{where}: gradient of {name} off by {error:.2e}"


# One of each path a block can take: varlen attention, a sliding window, softcapping (eager per sample), sinks, experts,
# gated delta rules beside attention, Mamba beside attention and experts, and Mamba2 alone (padded rows).
ONE_GRAPH = ("llama", "mistral (window)", "gemma2", "gpt-oss", "qwen3-moe", "qwen3-next", "jamba", "mamba2")


def test_every_kind_of_block_traces_as_one_graph(folders, references):
    """--compile's precondition: each block traces whole (``fullgraph=True``; dynamo alone, no code generated), so nothing
    a block does per call (a host read, a data-dependent branch) splits it into pieces that run eagerly between graphs;
    and the traced blocks give transformers' loss."""
    from litft.model.weights import transformer_blocks

    by_name = {a.name: a for a in TRAINED}
    for name in ONE_GRAPH:
        torch._dynamo.reset()
        lm = as_litft_builds_it(folders[name])
        for block in transformer_blocks(lm.hf_model):
            block.compile(fullgraph=True, backend="eager")
        padding_free = not carries_state(by_name[name].build())
        batch = collate(pack(samples(), max_length=64), pad_id=0, padding_free=True) if padding_free else collate(samples(), pad_id=0)
        loss = lm.loss_sum(batch)  # a graph break raises here, naming the line that broke it
        loss.backward()
        expected = references[name][0]
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), name
    torch._dynamo.reset()


def test_a_packed_row_would_carry_state_across_samples(folders, references):
    """Why state-carrying models get a sample per row: in a packed row Mamba's second sample starts from the first one's state."""
    lm = as_litft_builds_it(folders["mamba"])
    lm.whole_rows = False
    packed = lm.loss_sum(collate(pack(samples(), max_length=64), pad_id=0, padding_free=True)).item()
    expected = references["mamba"][0].item()
    assert abs(packed - expected) > 1e-3 * expected


def test_lora_all_linear_leaves_out_what_mamba_kernels_read_past_an_adapter():
    """mamba-ssm's fused kernels take a Mamba mixer's out_proj.weight directly: all-linear leaves it out (peft refuses it for
    Falcon-H1), and keeps every other linear layer, attention's output included."""
    from litft.config import LoraArgs
    from litft.model.lora import resolved_targets
    from litft.model.weights import skeleton

    model = skeleton(next(a for a in ARCHITECTURES if a.name == "falcon-h1").build(), torch.float32)
    targets = resolved_targets(LoraArgs(), model)
    assert "model.layers.0.mamba.in_proj" in targets and "model.layers.0.self_attn.o_proj" in targets
    assert not any(t.endswith("mamba.out_proj") or t == "lm_head" for t in targets)
    mamba = resolved_targets(LoraArgs(), skeleton(next(a for a in ARCHITECTURES if a.name == "mamba").build(), torch.float32))
    assert {t.rpartition(".")[2] for t in mamba} == {"in_proj"}  # Mamba1 reads x_proj and dt_proj as matrices too
    llama = skeleton(ARCHITECTURES[0].build(), torch.float32)
    assert resolved_targets(LoraArgs(), llama) == "all-linear"


def test_qlora_keeps_mamba_output_projections_out_of_4_bits(folders, tmp_path):
    """Falcon-H1 under QLoRA at default flags: the mixers' out_proj (read by mamba-ssm as a matrix) and the head stay in the
    compute dtype, every other linear layer is 4-bit, and two steps train."""
    from litft.config import EvalArgs, TrainArgs
    from litft.data import TinyTasks
    from litft.cli.jobs import JOBS

    result = JOBS["finetune_lora"](str(folders["falcon-h1"]), out_dir=tmp_path / "run", quantize="bnb.nf4",
                                   data=TinyTasks(num_train=16, num_val=4), precision="bf16-true", accelerator="cpu", logger_name="csv",
                                   train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=2, save_interval=None),
                                   eval=EvalArgs(interval=10**6, initial_validation=False))
    kinds = {name: type(m.base_layer if hasattr(m, "base_layer") else m).__name__ for name, m in result.model.named_modules()
             if name.endswith(("out_proj", "in_proj", "lm_head"))}
    assert {k for k, v in kinds.items() if v == "Linear4bit"} == {k for k in kinds if k.endswith("in_proj")} and kinds
    assert all(v == "Linear" for k, v in kinds.items() if not k.endswith("in_proj"))
    assert all(h["loss"] > 0 for h in result.history if "loss" in h)


def test_a_preference_pair_puts_each_answer_on_its_own_row(folders):
    """A pair's chosen and rejected answers share a sample; on padded rows each gets a row, so Mamba scores the rejected one
    from its initial state: its log-probs equal the answer's alone."""
    lm = as_litft_builds_it(folders["mamba"])
    chosen, rejected = samples()[:2]
    pair = {key: torch.cat([chosen[key], rejected[key]]) for key in ("input_ids", "labels")}
    pair.update(position_ids=torch.cat([torch.arange(len(chosen["input_ids"])), torch.arange(len(rejected["input_ids"]))]),
                id=torch.tensor(0), rejected_start=torch.tensor(len(chosen["input_ids"])))
    batch = collate([pair], pad_id=0)
    assert batch["input_ids"].shape[0] == 2 and batch["targets"]["sequence"].unique().tolist() == [0, 1]
    with torch.no_grad():
        together = torch.zeros(2).index_add_(0, batch["targets"]["sequence"], lm.token_log_probs(batch)[0])
        alone = torch.stack([lm.token_log_probs(collate([s], pad_id=0))[0].sum() for s in (chosen, rejected)])
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if a.refused], ids=lambda a: a.name)
def test_architectures_litft_cannot_train_are_refused_in_one_line(architecture, folders):
    with pytest.raises(LitftError, match=architecture.refused) as refusal:
        check_architecture(load_config(str(folders[architecture.name])))
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("release", ["2.10", "2.13"])
def test_windows_softcapping_and_sinks_on_the_gpu_branch(folders, references, release):
    """The CUDA varlen branch (a stand-in kernel on the CPU) in bf16: a window goes to the kernel where it takes one, softcapping and
    sinks to the model's own eager attention; the loss stays within bf16's rounding of transformers' fp32 loss."""
    previous = use_varlen_kernel(VarlenKernel.of(STANDINS[release]))
    try:
        for name, paths in (("mistral (window)", {"varlen"} if release == "2.13" else {"windowed sdpa"}), ("gemma2", {"eager"}), ("gpt-oss", {"eager"})):
            attention.RECORD.clear()
            lm = as_litft_builds_it(folders[name], torch.bfloat16)
            loss = lm.loss_sum(collate(pack(samples(), max_length=64), pad_id=0, padding_free=True))
            assert attention.RECORD.paths() == paths, (name, attention.RECORD.seen)
            expected = references[name][0].item()
            assert abs(loss.item() - expected) <= 2e-2 * expected, (name, loss.item(), expected)
    finally:
        use_varlen_kernel(previous)


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


JOB_CASES = [("finetune_full", "mistral (window)"), ("finetune_full", "qwen3-moe"), ("finetune_full", "gpt-neox"),
             ("finetune_lora", "gemma2"), ("finetune_lora", "qwen3-moe"), ("finetune_lora", "gpt-oss"),
             ("finetune_lora", "falcon-h1"), ("finetune_lora", "granite-4 hybrid"), ("finetune_full", "qwen3-next"), ("finetune_lora", "lfm2"),
             ("finetune_lora", "mamba"), ("finetune_full", "llama4 (chunked)"), ("finetune_lora", "llama4 (chunked)")]


@pytest.mark.parametrize("job, name", JOB_CASES, ids=[f"{j}-{n.split()[0]}" for j, n in JOB_CASES])
def test_jobs_train_and_export_what_transformers_loads(job, name, folders, tmp_path):
    """The job at its default flags (LoRA's dropout and targets included) trains, and what it exports loads in transformers
    (peft for an adapter) with the trained model's logits; a full run's export loads in litft again, at the same loss."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from litft.config import EvalArgs, TrainArgs
    from litft.data import TinyTasks
    from litft.cli.jobs import JOBS

    flags = dict(data=TinyTasks(num_train=32, num_val=8), train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=2, save_interval=None),
                 eval=EvalArgs(interval=10**6, initial_validation=False), accelerator="cpu", logger_name="csv")
    result = JOBS[job](str(folders[name]), out_dir=tmp_path / "run", **flags)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    base = AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
    exported = PeftModel.from_pretrained(base, result.final_dir) if job == "finetune_lora" else AutoModelForCausalLM.from_pretrained(result.final_dir)
    torch.testing.assert_close(logits(exported, ids), logits(result.model, ids), rtol=1e-4, atol=1e-5)
    logged = [h for h in result.history if "loss" in h]
    if "MoE" in next(a for a in ARCHITECTURES if a.name == name).features:  # the router's balance is logged at each log step
        assert all(h["expert_imbalance_max"] >= h["expert_imbalance_mean"] >= 1.0 for h in logged), logged
    else:
        assert not any("expert_imbalance_max" in h for h in logged)
    if job == "finetune_full":  # litft reads its own export: the first validation equals the last of the run
        again = JOBS[job](str(result.final_dir), out_dir=tmp_path / "again", **dict(
            flags, train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=1, save_interval=None),
            eval=EvalArgs(interval=10**6, initial_validation=True, final_validation=False)))
        last = [h["val_loss"] for h in result.history if "val_loss" in h][-1]
        first = [h["val_loss"] for h in again.history if "val_loss" in h][0]
        assert abs(first - last) <= 1e-5 * abs(last)


def test_a_loss_that_is_not_finite_stops_the_run_before_anything_is_saved(folders, tmp_path):
    """A model whose loss is NaN from the first step: one line naming the step, no checkpoint, no export, and the job fails."""
    from safetensors.torch import load_file, save_file

    from litft.config import EvalArgs, TrainArgs
    from litft.data import TinyTasks
    from litft.cli.jobs import finetune_full

    broken = tmp_path / "broken"
    shutil.copytree(folders["llama"], broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LitftError, match="not finite .* at step 1;") as stop:
        finetune_full(str(broken), out_dir=tmp_path / "run", data=TinyTasks(num_train=32, num_val=8), accelerator="cpu", logger_name="csv",
                      train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=3, save_interval=1), eval=EvalArgs(initial_validation=False))
    assert "\n" not in str(stop.value)
    assert not (tmp_path / "run" / "final").exists()
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))


def test_context_and_tensor_parallel_refuse_what_they_cannot_split(folders):
    """Before any process starts: per-head sinks (gpt-oss) under CP and TP; under TP a model with neither a plan nor Llama's
    names, a plan style litft does not know, and a per-head norm beside split heads with no plan for its gradient."""
    from transformers import AutoConfig

    from litft.parallel.context import check_context_parallel
    from litft.parallel.tensor import check_tensor_parallel

    config = lambda name: load_config(str(folders[name]))  # noqa: E731
    for name in ("llama", "mistral (window)", "gemma2", "qwen3-moe", "qwen3", "phi3", "olmo2", "gpt-neox"):
        check_context_parallel(config(name), 2)
        check_tensor_parallel(config(name), 2)
    with pytest.raises(LitftError, match="--context_parallel deals attention heads .*sinks"):
        check_context_parallel(config("gpt-oss"), 2)
    with pytest.raises(LitftError, match="--tensor_parallel splits attention heads, and gpt_oss's per-head .*sinks"):
        check_tensor_parallel(config("gpt-oss"), 2)
    planless = config("qwen3")
    planless.base_model_tp_plan = None  # Llama's names then split the heads, and q_norm would get one rank's gradient
    with pytest.raises(LitftError, match="splits qwen3's heads, and self_attn.q_norm .* no plan for its gradient"):
        check_tensor_parallel(planless, 2)
    odd = config("llama")
    odd.base_model_tp_plan = {**odd.base_model_tp_plan, "layers.*.self_attn.o_proj": "rowwise_sequence"}
    with pytest.raises(LitftError, match="does not know the style 'rowwise_sequence'"):
        check_tensor_parallel(odd, 2)
    neither = AutoConfig.for_model("gpt_neox", **{k: v for k, v in config("gpt-neox").to_dict().items() if k != "model_type"})
    neither.base_model_tp_plan = None
    with pytest.raises(LitftError, match="needs a tensor-parallel plan .* and gpt_neox has neither"):
        check_tensor_parallel(neither, 2)


def test_tensor_parallel_splits_as_the_models_plan_says(folders):
    """What each block layer becomes under TP: the plan's styles (fused projections gathered, per-head norms summed, experts
    whole), Llama's names only where a model has no plan."""
    from litft.parallel.tensor import block_plan, split_layers
    from litft.model.weights import skeleton, transformer_blocks

    def kinds(name):
        config = load_config(str(folders[name]))
        return split_layers(transformer_blocks(skeleton(config, torch.float32))[0], block_plan(config))

    assert kinds("phi3") == {"self_attn.qkv_proj": "column gathered", "self_attn.o_proj": "row from whole",
                             "mlp.gate_up_proj": "column gathered", "mlp.down_proj": "row from whole"}
    assert kinds("qwen3")["self_attn.q_norm"] == kinds("qwen3")["self_attn.k_norm"] == "summed"
    assert kinds("olmo2")["self_attn.q_proj"] == "column gathered" and kinds("olmo2")["mlp.down_proj"] == "row"
    assert kinds("gpt-neox") == {"attention.query_key_value": "column", "attention.dense": "row", "mlp.dense_h_to_4h": "column",
                                 "mlp.dense_4h_to_h": "row"}
    assert not any("experts" in name for name in kinds("qwen3-moe")) and kinds("qwen3-moe")["self_attn.o_proj"] == "row"
    assert kinds("phimoe") == {f"self_attn.{p}_proj": "row" if p == "o" else "column" for p in "qkvo"}  # its plan names experts only


def test_router_load_balancing_loss_is_added_as_transformers_adds_it(folders, tmp_path):
    """A MoE config that asks for the router's auxiliary loss: the training loss and its gradients are transformers' own
    (mean cross-entropy + coef x aux), the aux value is kept for the log, and FLOPs count the top-k experts a token runs."""
    import json

    from transformers import AutoModelForCausalLM

    from litft.model.flops import model_shape

    folder = tmp_path / "qwen3-moe-aux"
    shutil.copytree(folders["qwen3-moe"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, output_router_logits=True, router_aux_loss_coef=0.3)))
    sample = samples()[1]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").train()
    out = reference(sample["input_ids"][None], labels=sample["input_ids"][None])
    assert out.aux_loss is not None
    out.loss.backward()
    lm = as_litft_builds_it(folder)
    loss = lm.loss_sum(collate([sample], pad_id=0)) / (len(sample["input_ids"]) - 1)
    loss.backward()
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
    for name, param in reference.named_parameters():
        got = lm.hf_model.get_parameter(name).grad
        assert (got - param.grad).norm() <= 1e-4 * param.grad.norm(), name
    aux = lm.take_router_aux()
    assert aux is not None and abs(aux.item() - out.aux_loss.item()) <= 1e-5 and lm.take_router_aux() is None
    shape = model_shape(load_config(str(folder)))
    assert shape.intermediate == 2 * 32 and shape.router == 4  # top-2 of 4 experts of width 32


def test_models_page_table_is_the_one_the_list_gives():
    from pathlib import Path

    from tests.architectures import table

    assert table() in (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()


def test_a_checkpoint_missing_a_tensor_is_refused_in_one_line(folders, tmp_path):
    """Whether or not transformers converts its layout: from_pretrained would fill the gap with random values."""
    from safetensors.torch import load_file, save_file

    for name, dropped in (("llama", "model.layers.0.mlp.down_proj.weight"), ("qwen3-moe", "model.layers.0.mlp.experts.0.down_proj.weight")):
        broken = tmp_path / name
        shutil.copytree(folders[name], broken)
        tensors = load_file(broken / "model.safetensors")
        del tensors[dropped]
        save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(LitftError, match="has no tensor for model.layers.0.mlp|holds 3 tensors for model.layers.0.mlp") as refusal:
            as_litft_builds_it(broken)
        assert "\n" not in str(refusal.value)


def test_state_carrying_models_get_an_estimate_and_no_mfu(folders, capsys):
    """Their layers' FLOPs are not counted yet: the run says so instead of an MFU that counts attention in every layer, and
    the estimate still counts their memory."""
    from litft.__main__ import main
    from litft.model.flops import StepFlops

    assert StepFlops.for_run(load_config(str(folders["qwen3-next"])), None, "32-true", torch.device("cpu"), say=print) is None
    assert "no MFU for this run: qwen3_next's state-carrying layers" in capsys.readouterr().out
    main(["estimate", str(folders["qwen3-next"]), "--job", "finetune_lora", "--seq_len", "32"])
    assert "peak" in capsys.readouterr().out


def test_packing_a_state_carrying_model_is_refused_in_one_line(folders, tmp_path):
    from litft.data import TinyTasks
    from litft.cli.jobs import JOBS

    with pytest.raises(LitftError, match="--data.packing puts several samples in one row, and mamba's") as refusal:
        JOBS["finetune_full"](str(folders["mamba"]), out_dir=tmp_path / "run", data=TinyTasks(num_train=8, packing=True), accelerator="cpu")
    assert "\n" not in str(refusal.value)


def test_a_composite_folder_trained_as_its_text_model_exports_a_text_model_folder():
    """A Qwen3.5 checkpoint as the hub holds it (the image-text class, a composite config) trains as transformers' causal-LM
    class, its text model: the export's config is the text config naming that class, so the folder loads as the weights it
    holds (it named the image-text class before, which loaded none of them). Other folders keep their config, Llama 4's
    composite among them (trained as the image-text model it is)."""
    import transformers

    from litft.checkpoint.convert import config_of
    from litft.model.weights import skeleton

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, attention_chunk_size=6, num_local_experts=2)
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=8,
                  projector_input_dim=64, projector_output_dim=64, vision_output_dim=64)
    composite = transformers.Llama4Config(text_config=text, vision_config=vision, architectures=["Llama4ForConditionalGeneration"])
    written = config_of(skeleton(composite, torch.float32), composite)
    assert written.model_type == "llama4" and written.architectures == ["Llama4ForConditionalGeneration"]
    qwen = transformers.Qwen3_5Config(text_config=dict(COMMON, layer_types=["linear_attention", "full_attention"], head_dim=8),
                                      vision_config=dict(depth=1, hidden_size=32, num_heads=4, out_hidden_size=32))
    written = config_of(skeleton(qwen, torch.float32), qwen)
    assert written.model_type == "qwen3_5_text" and written.architectures == ["Qwen3_5ForCausalLM"]
    plain = ARCHITECTURES[0].build()
    assert config_of(skeleton(plain, torch.float32), plain) is plain and plain.architectures == ["LlamaForCausalLM"]


def test_a_composite_folder_says_on_its_first_screen_that_it_trains_its_text_model(tmp_path, capsys):
    """A Qwen3.5 folder as the hub holds it (the image-text class, saved whole) trains as its text model, and the first screen
    says what that leaves out: a user of the hub checkpoint would otherwise find its image encoder missing from final/."""
    import json

    import transformers

    from litft.cli.jobs import JOBS
    from litft.config import EvalArgs, TrainArgs
    from litft.data import TinyTasks
    from litft.model.loading import load_tokenizer
    from litft.model.tiny import ensure_tiny_model

    qwen = transformers.Qwen3_5Config(text_config=dict(COMMON, layer_types=["linear_attention", "full_attention"], head_dim=8),
                                      vision_config=dict(depth=1, hidden_size=32, num_heads=4, out_hidden_size=32))
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(qwen, dtype=torch.float32).save_pretrained(tmp_path / "model")
    load_tokenizer(str(ensure_tiny_model())).save_pretrained(tmp_path / "model")
    result = JOBS["finetune_full"](str(tmp_path / "model"), out_dir=tmp_path / "run", data=TinyTasks(num_train=8, num_val=2),
                                   train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, save_interval=None),
                                   eval=EvalArgs(interval=10**6, initial_validation=False, final_validation=False), accelerator="cpu",
                                   logger_name="csv")
    said = capsys.readouterr().out
    assert ("vision: this Qwen3_5ForConditionalGeneration folder trains as its text model, Qwen3_5ForCausalLM (transformers' "
            "causal-LM class) on these text records: its image encoder is not loaded, and final/ holds the text model alone (records "
            "with images train the image-text model)") in said, said[-2000:]
    assert json.loads((result.final_dir / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    # The estimate counts what trains (the text model) and names the attention it built (the composite config names none).
    from litft.__main__ import main

    main(["estimate", str(tmp_path / "model"), "--job", "finetune_full", "--seq_len", "32", "--accelerator", "cpu"])
    text = sum(p.numel() for p in result.model.parameters())
    assert text < sum(p.numel() for p in transformers.AutoModelForImageTextToText.from_config(qwen).parameters())
    said = capsys.readouterr().out
    assert f"{text / 1e3:.2f}K parameters, {text / 1e3:.2f}K trained" in said and ", sdpa attention" in said, said
