"""Activation offload and tiled MLP (litft.model.offload, litft.model.tiled_mlp) through litft's own module: the offloaded step
is bit for bit the plain one, under checkpointing only the blocks' inputs move, every copy is waited for in order, and the
tiled MLP gives the untiled step's loss and gradients while the forward keeps far less."""

import pytest
import torch

from litft.config import Layout, LoraArgs, TrainArgs
from litft.model.offload import ActivationOffload, _SameStream
from litft.model.tiled_mlp import dense_mlp
from litft.model.weights import transformer_blocks
from litft.parallel.strategies import SingleDevice
from litft.run.build import build_module

SEQ = 96


def step(tiny_dir, precision="32-true", lora=None, **train):
    """One forward and backward of the tiny model's module at ``precision``: the loss, the gradients and the module."""
    train = TrainArgs(**train)
    strategy = SingleDevice(Layout(), "cpu", precision, train)
    lm, fill, _ = build_module(str(tiny_dir), precision, lora, train, 1, random_init=False, seed=0, device=torch.device("cpu"),
                               strategy=strategy)
    fill(lm)
    lm.train()
    with torch.no_grad():  # lora_B starts at zero: give the adapters a say in the output
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    tokens = torch.randint(5, 300, (2, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(SEQ).expand(2, -1)}
    torch.manual_seed(2)  # the adapters' dropout masks
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = lm.loss_sum(batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}, lm


# Dropout on: its masks are drawn again in a recompute (a tiled MLP's too: on the CPU a mask's saved positions vary in number
# with the draw, so torch's checkpoint refuses a recompute that draws other masks than its forward).
LORA = LoraArgs(r=4, alpha=8, dropout=0.1, target_modules="all-linear")
CASES = {"full-32": ("32-true", None, False, False), "full-bf16-true-checkpointed": ("bf16-true", None, True, False),
         "lora-bf16-mixed-checkpointed": ("bf16-mixed", LORA, True, False), "lora-32-tiled": ("32-true", LORA, False, True)}


def test_checkpointed_lora_dropout_draws_the_forwards_masks_again(tiny_dir):
    """A checkpointed block's recompute draws the same masks, shared by the same adapters, as the forward it repeats."""
    loss, grads, _ = step(tiny_dir, "32-true", LORA)
    loss_again, grads_again, _ = step(tiny_dir, "32-true", LORA, gradient_checkpointing=True)
    assert torch.equal(loss, loss_again) and all(torch.equal(grads[n], grads_again[n]) for n in grads)
    assert not torch.equal(loss, step(tiny_dir, "32-true", LoraArgs(r=4, alpha=8, target_modules="all-linear"))[0])  # dropout was on


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_offloaded_step_is_the_plain_step_bit_for_bit(tiny_dir, case):
    precision, lora, checkpointing, tiled = CASES[case]
    loss, grads, _ = step(tiny_dir, precision, lora, gradient_checkpointing=checkpointing, tiled_mlp=tiled)
    loss_off, grads_off, lm = step(tiny_dir, precision, lora, gradient_checkpointing=checkpointing, tiled_mlp=tiled, activation_offload=True)
    assert torch.equal(loss, loss_off) and grads.keys() == grads_off.keys()
    assert all(torch.equal(grads[n], grads_off[n]) for n in grads)
    config = lm.hf_model.config
    hidden = 2 * SEQ * config.hidden_size * (2 if precision.startswith("bf16") else 4)
    if checkpointing:  # each block's input and a trained embedding's ids; past the last block nothing (the backward starts there)
        assert lm.offloaded_bytes == config.num_hidden_layers * hidden + (2 * SEQ * 8 if lora is None else 0)
    else:  # tiled, the MLP's intermediate is recomputed, not kept: its chunks' inputs move (one block input's worth)
        assert lm.offloaded_bytes > (2 if tiled else 3) * config.num_hidden_layers * hidden


def test_offload_waits_for_every_copy_and_fetches_ahead_once():
    """The stream protocol, with a stand-in that records it: each tensor moved is kept until its copy is done, each one
    fetched back is handed to the compute stream before use, every fetch but the first is ahead of its use, and nothing
    is fetched twice."""
    calls = []

    class Recording(_SameStream):
        def keep_until_copied(self, tensor):
            calls.append(("kept", tensor.shape))

        def hand_over(self, tensor, ready):
            calls.append(("handed", tensor.shape))

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 16, requires_grad=True)
    offload = ActivationOffload(blocks=4, streams=lambda device: Recording())
    with offload.hooks():
        y = layers(x).square().sum()
    # x and the four tanh outputs: each is saved twice (by tanh and the next Linear, by the last tanh and the square), copied once
    assert len(offload.saved) == 5 and [c[0] for c in calls] == ["kept"] * 5
    assert offload.saved[-1].ahead and not offload.saved[0].ahead  # the backward's first need is on its way back already
    y.backward()
    expected = torch.autograd.grad(layers(x).square().sum(), [x, *layers.parameters()])
    assert all(torch.equal(g, e) for g, e in zip([x.grad, *(p.grad for p in layers.parameters())], expected))
    assert [c[0] for c in calls[5:]] == ["handed"] * 9  # one hand-over per use
    assert offload.fetched_bytes == offload.moved_bytes and offload._ahead_bytes == 0
    assert all(s.on_device is None for s in offload.saved)  # nothing left on the device once the backward has used it


def test_offload_leaves_weights_and_their_casts_on_the_device():
    """Under autocast a trained Linear saves its weight's bf16 cast, transposed: a view of a cast of a parameter, which the
    step keeps anyway (autocast caches it); only the activations move."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    offload = ActivationOffload(min_bytes=0)
    with torch.autocast("cpu", torch.bfloat16), offload.hooks():
        y = torch.nn.functional.gelu(layer(torch.tanh(x)))
    assert offload.saved and all(tuple(s.shape) == (8, 64) for s in offload.saved)
    y.float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_tiled_mlp_gives_the_untiled_step_and_keeps_less(tiny_dir):
    saved = {}

    def counting(lm_step, **train):
        total = [0]

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = lm_step(tiny_dir, **train)
        return out, total[0]

    (loss, grads, _), saved["plain"] = counting(step)
    (loss_tiled, grads_tiled, lm), saved["tiled"] = counting(step, tiled_mlp=True)
    assert lm.model.tiled_mlps == lm.hf_model.config.num_hidden_layers
    torch.testing.assert_close(loss_tiled, loss, rtol=1e-6, atol=0)
    for name in grads:  # the weights' gradients are summed chunk by chunk: float rounding apart, relative to their size
        assert torch.linalg.vector_norm(grads_tiled[name] - grads[name]) <= 1e-5 * torch.linalg.vector_norm(grads[name]), name
    config = lm.hf_model.config
    # The gate, up and activation products (three tokens x intermediate tensors a block) are no longer kept.
    intermediate = 3 * 2 * SEQ * config.intermediate_size * 4 * config.num_hidden_layers
    assert saved["plain"] - saved["tiled"] >= 0.9 * intermediate, saved


def test_tiled_mlp_leaves_a_mixture_of_experts_whole():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    blocks = transformer_blocks(Qwen3MoeForCausalLM(config))
    assert dense_mlp(blocks[0]) is None and dense_mlp(blocks[1]) is blocks[1].mlp
