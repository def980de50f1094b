"""Batches reach attention without an S x S mask: padded rows keep SDPA's causal kernel, packed rows are kept apart by litft_segments."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from litft.model import attention

from litft.model import varlen
from litft.model.attention import SEGMENTS
from litft.model.varlen import VarlenKernel
from litft.config import TrainArgs
from litft.objectives import next_token
from litft.data.collate import collate
from litft.data.samples import IGNORE_INDEX, pack
from litft.errors import LitftError
from litft.model.causal_lm import CausalLM
from litft.model.loading import load_causal_lm
from tests.varlen_standins import STANDINS


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every call of torch's SDPA: its mask, is_causal and enable_gqa."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append({"mask": attn_mask, "is_causal": is_causal, "gqa": enable_gqa, "rows": query.shape[0], "length": query.shape[-2]})
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def tiny_lm(tiny_dir, attention: str) -> CausalLM:
    model = load_causal_lm(str(tiny_dir), random_init=False, dtype=torch.float32)
    model.set_attn_implementation(attention)
    return CausalLM(model, TrainArgs(), next_token()).train()


def samples(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(5, 300, (n,), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone(), "id": torch.tensor(i)})
    return out


def test_padded_rows_keep_the_causal_kernel_and_native_gqa(tiny_dir, sdpa_calls):
    """Right padding whose positions count on is not mistaken for packing: no 4-D mask, is_causal, K/V not repeated."""
    lm = tiny_lm(tiny_dir, "sdpa")
    batch = collate(samples([5, 8, 3]), pad_id=0)
    assert batch["position_ids"][0].tolist() == list(range(8))
    padded = lm(batch["input_ids"], batch["position_ids"])
    assert len(sdpa_calls) == 4 and all(c["mask"] is None and c["is_causal"] and c["gqa"] for c in sdpa_calls)
    for row, sample in enumerate(samples([5, 8, 3])):  # the real tokens' logits are those of the sample alone
        alone = lm(sample["input_ids"][None])
        torch.testing.assert_close(padded[row, : len(sample["input_ids"])], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gathered", [True, False])
def test_packed_rows_are_kept_apart_without_a_mask(tiny_dir, sdpa_calls, monkeypatch, gathered):
    """On the CPU one causal SDPA call per layer with a row per sample (or a call per sample where lengths are far
    apart); logits, loss and gradients equal each sample trained alone."""
    monkeypatch.setattr(attention, "GATHER_PADDING_LIMIT", 1.5 if gathered else 1.0)  # 4 x 9 = 36 places for 25 tokens
    lengths = [5, 9, 4, 7]
    lm = tiny_lm(tiny_dir, SEGMENTS)
    packed = collate(pack(samples(lengths), max_length=32), pad_id=0, padding_free=True)
    assert packed["input_ids"].shape == (1, 25)
    loss = lm.loss_sum(packed)
    calls = [(len(lengths), max(lengths))] if gathered else [(1, n) for n in lengths]
    assert [(c["rows"], c["length"]) for c in sdpa_calls] == calls * 4
    assert all(c["mask"] is None and c["is_causal"] for c in sdpa_calls)
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in lm.named_parameters()}

    lm.zero_grad()
    reference = tiny_lm(tiny_dir, "sdpa")
    expected = 0.0
    for i, sample in enumerate(samples(lengths)):
        single = collate([sample], pad_id=0)
        if i:  # pack() does not train a sample's first token on the sample before it
            single["labels"][0, 0] = IGNORE_INDEX
        expected = expected + reference.loss_sum(single)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


real_find_spec = importlib.util.find_spec


@pytest.fixture(params=sorted(STANDINS))
def standin(request):
    """torch's varlen kernel as each torch release shipped it, on the CPU (tests/varlen_standins.py)."""
    kernel = VarlenKernel.of(STANDINS[request.param])
    previous = varlen.use_varlen_kernel(kernel)
    attention.RECORD.clear()
    yield request.param, kernel
    varlen.use_varlen_kernel(previous)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_cuda_path_through_each_torch_signature(tiny_dir, standin, precision):
    """The varlen branch with each signature torch shipped: only keywords that release takes (G1), fp32 kept
    off the kernel (G2), K/V repeated where there is no enable_gqa; the loss and gradients equal SDPA's."""
    release, kernel = standin
    lengths = [5, 9, 4, 7]
    batch = collate(pack(samples(lengths), max_length=32), pad_id=0, padding_free=True)
    results = []
    for implementation in (SEGMENTS, "sdpa"):
        lm = tiny_lm(tiny_dir, implementation)
        if precision == "bf16-true":
            lm = lm.to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = lm.loss_sum(batch)
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in lm.named_parameters()}))
    (got, got_grads), (expected, expected_grads) = results
    if precision == "32-true":
        assert attention.RECORD.paths() == {"sdpa"}, attention.RECORD.seen
        assert attention.RECORD.computed() == {"float32"}
    else:
        assert attention.RECORD.paths() == {"varlen"}, attention.RECORD.seen
        assert attention.RECORD.computed() == {"bfloat16"}
    assert varlen.segments_path("cpu", precision, kernel)[0] == ("sdpa" if precision == "32-true" else "varlen")
    error = 1e-5 if precision == "32-true" else 3e-2  # bf16 rounds differently in the two paths
    assert abs(got - expected) <= error * abs(expected)
    for name, grad in expected_grads.items():
        assert torch.linalg.vector_norm(got_grads[name] - grad) <= error * torch.linalg.vector_norm(grad) + 1e-6, name


def test_a_kernel_is_read_from_its_signature():
    """What each torch release's kernel is given, read from its signature; a non-default scale never goes to 2.10's."""
    from tests.varlen_standins import varlen_attn_2_10, varlen_attn_2_11, varlen_attn_2_13

    old, middle, new = (VarlenKernel.of(f) for f in (varlen_attn_2_10, varlen_attn_2_11, varlen_attn_2_13))
    assert (old.takes_gqa, middle.takes_gqa, new.takes_gqa) == (False, False, True)
    assert old.runs("cpu", torch.bfloat16, 8**-0.5, 8) and not old.runs("cpu", torch.bfloat16, 0.3, 8)
    assert middle.runs("cpu", torch.bfloat16, 0.3, 8) and not middle.runs("cpu", torch.float32, None, 8)
    assert not new.runs("cuda", torch.bfloat16, None, 8)  # a stand-in runs where it says
    real = varlen.find_varlen_kernel("")
    if real is not None:  # torch >= 2.10: the real kernel, read the same way
        assert real.device_type == "cuda" and real.causal
    with pytest.raises(LitftError, match="LITFT_VARLEN_KERNEL=nowhere:kernel cannot be imported"):
        varlen.find_varlen_kernel("nowhere:kernel")


@pytest.mark.parametrize("gathered", [True, False])
def test_cpu_bf16_mixed_packed_attention(tiny_dir, monkeypatch, gathered):
    """G6: under CPU autocast q and k leave rotary in fp32 and v is bf16; both CPU paths attend in bf16 and train."""
    monkeypatch.setattr(attention, "GATHER_PADDING_LIMIT", 1.5 if gathered else 1.0)
    previous = varlen.use_varlen_kernel(None)
    try:
        attention.RECORD.clear()
        lm = tiny_lm(tiny_dir, SEGMENTS)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm.loss_sum(collate(pack(samples([5, 9, 4, 7]), max_length=32), pad_id=0, padding_free=True))
        loss.backward()
    finally:
        varlen.use_varlen_kernel(previous)
    assert attention.RECORD.computed() == {"bfloat16"} and torch.isfinite(loss)


def test_segments_attention_without_position_ids_is_plain_causal(tiny_dir):
    """transformers makes (1, S) position ids when none are given; every row of the batch is one sample then."""
    ids = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tiny_lm(tiny_dir, "sdpa").model(ids).logits
        got = tiny_lm(tiny_dir, SEGMENTS).model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels are Triton GPU kernels")
def test_liger_kernels_train_as_the_models_own(tiny_dir):
    """Where they run: the same loss and gradients as the model's own norm, rotary and MLP."""
    pytest.importorskip("liger_kernel")
    from litft.model.kernels import use_liger_kernels

    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in collate(samples([9, 14]), pad_id=0).items()}
    results = []
    for liger in (False, True):
        model = load_causal_lm(str(tiny_dir), random_init=False, dtype=torch.float32).cuda()
        if liger:
            use_liger_kernels(model)
        lm = CausalLM(model, TrainArgs(), next_token()).train()
        loss = lm.loss_sum(batch)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in lm.named_parameters()}))
    (plain, plain_grads), (fused, fused_grads) = results
    assert abs(plain - fused) <= 1e-4 * plain
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts what would wait for a GPU inside the decoder layers: a value read back to the host, or a shape that needs one."""

    READS = {"item", "tolist", "__int__", "__bool__", "__float__", "__index__", "cpu", "numpy", "nonzero", "masked_select", "unique",
             "bincount"}  # bincount sizes its output from the largest id, read back first

    def __init__(self, layers=(), everywhere: bool = False):
        super().__init__()
        self.depth, self.paused, self.reads = int(everywhere), False, []
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: setattr(self, "depth", self.depth + 1))
            layer.register_forward_hook(lambda *_: setattr(self, "depth", self.depth - 1))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        boolean_index = name in ("__getitem__", "__setitem__") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        to_host = name == "to" and "cpu" in [a for a in args[1:] if isinstance(a, str)]
        # Repeats given as a tensor size the output from their sum, unless output_size says it.
        sized_by_device = name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else (kwargs or {}).get("repeats"), torch.Tensor) \
            and (kwargs or {}).get("output_size") is None
        if self.depth and not self.paused and (name in self.READS or boolean_index or to_host or sized_by_device):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path, lengths", [("varlen", [9, 7, 8, 8]), ("gathered", [9, 7, 8, 8]), ("per sample", [30, 2, 3])])
def test_no_host_reads_inside_the_decoder_layers(tiny_dir, path, lengths):
    """Sample boundaries are computed once per micro-batch by collate; no layer reads one back (on a GPU each read is a
    stall, twice per layer per step before). The varlen kernel's stand-in computes on the host and is not counted."""
    from functools import wraps

    from litft.config import LoraArgs
    from litft.model.lora import apply_lora

    counter = None

    @wraps(STANDINS["2.13"])
    def kernel(*args, **kwargs):
        counter.paused = True
        try:
            return STANDINS["2.13"](*args, **kwargs)
        finally:
            counter.paused = False

    previous = varlen.use_varlen_kernel(VarlenKernel.of(kernel))
    try:
        model = load_causal_lm(str(tiny_dir), random_init=False, dtype=torch.bfloat16 if path == "varlen" else torch.float32)
        model.set_attn_implementation(SEGMENTS)
        model = apply_lora(model, LoraArgs(r=4, dropout=0.0))
        lm = CausalLM(model, TrainArgs(), next_token()).train()
        batch = collate(samples(lengths), pad_id=0, padding_free=True)
        attention.RECORD.clear()
        with HostReads(lm.hf_model.model.layers) as counter:
            lm.loss_sum(batch).backward()
        assert attention.RECORD.paths() == {"varlen" if path == "varlen" else "sdpa"}
        assert counter.reads == [], counter.reads
        with HostReads(lm.hf_model.model.layers) as fallback:  # the check itself sees reads: position ids only, no boundaries
            lm(batch["input_ids"], batch["position_ids"])
        assert fallback.reads
    finally:
        varlen.use_varlen_kernel(previous)


@pytest.mark.parametrize("run", ["dense", "moe", "lora on experts", "preference"])
def test_no_host_reads_in_a_training_step_of_moe_lora_experts_and_preference(run, tokenizer):
    """A whole micro-batch (forward, the router's load counter, the loss, backward) reads nothing back: MoE experts counted
    into fixed-size buffers, grouped matmuls given their sizes, preference figures filled on the device. (Expert parallel
    reads its all-to-all's split sizes once per MoE layer: torch takes them as host integers.)"""
    from litft.run.build import build_model
    from litft.config import LoraArgs
    from litft.objectives import build_objective
    from litft.objectives.args import ObjectiveArgs
    from litft.data.preference import TinyPreferences
    from litft.model.experts import ExpertLoad
    from litft.model.loading import load_config
    from litft.model.tiny import TINY_MOE_NAME, ensure_tiny_model
    from transformers import AutoModelForCausalLM

    moe = run in ("moe", "lora on experts")
    folder = ensure_tiny_model(TINY_MOE_NAME) if moe else ensure_tiny_model()
    lora = LoraArgs(r=4, dropout=0.0, target_modules=["gate_up_proj", "down_proj", "q_proj"]) if run == "lora on experts" else None
    # Built on the CPU with transformers' own init: buffers such as the rotary frequencies hold values, not whatever
    # memory to_empty() handed out (which made the figures NaN in some runs).
    model = build_model(load_config(str(folder)), "32-true", lora, False, attention=SEGMENTS,
                        structure=lambda config, dtype: AutoModelForCausalLM.from_config(config, dtype=dtype))
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02) if param.dim() > 1 else torch.nn.init.ones_(param)
    objective = build_objective(ObjectiveArgs(name="simpo" if run == "preference" else "sft"), lora=lora is not None)
    lm = CausalLM(model, TrainArgs(), objective).train()
    load = ExpertLoad.of(lm.hf_model)
    assert (load is not None) == moe
    if run == "dense":
        batch = collate(samples([9, 7, 8]), pad_id=0, padding_free=True)
        with HostReads(everywhere=True) as counter:
            lm.loss_sum(batch).backward()
        assert counter.reads == [], counter.reads
        return
    if run == "preference":
        batch = collate(TinyPreferences(num_train=4, num_val=0).tokenize(tokenizer, seed=1).train[:2], tokenizer.pad_token_id, padding_free=True)
    else:
        batch = collate(samples([9, 7, 8]), pad_id=0, padding_free=True)
    with HostReads(everywhere=True) as counter:
        lm.loss_sum(batch).backward()
        figures = lm.objective.take_figures() if run == "preference" else load.take()
    assert counter.reads == [], counter.reads
    assert figures is not None and torch.isfinite(figures).all()
    if lora is not None:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in lm.named_parameters() if "experts" in n and "lora_" in n)
