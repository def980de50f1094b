"""The loss on target tokens only equals the plain one, loss and gradients, and padding-free batches equal padded ones."""

import pytest
import torch
import torch.nn.functional as F

from litft.model import loss as fused
from litft.run.build import build_model
from litft.config import LoraArgs, TrainArgs
from litft.objectives import next_token
from litft.data.collate import collate
from litft.data.samples import IGNORE_INDEX
from litft.model.causal_lm import CausalLM
from litft.model.loading import load_config
from litft.model.weights import CheckpointWeights, Materializer


def plain_loss(hidden, weight, bias, labels):
    predicted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.flatten(0, 1), predicted.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("masked", ["some rows", "all"])
def test_chunked_target_loss_equals_the_plain_one(monkeypatch, masked):
    """fp32, a vocabulary of 97 (no chunk size divides it), chunks of 5 rows, a bias, masked tokens."""
    monkeypatch.setattr(fused, "CHUNK_LOGIT_BYTES", 5 * 4 * 97)
    assert fused.chunk_rows(97) == 5
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=generator, requires_grad=True)
    weight = torch.randn(97, 16, generator=generator, requires_grad=True)
    bias = torch.randn(97, generator=generator, requires_grad=True)
    labels = torch.randint(0, 97, (3, 11), generator=generator)
    labels[0, :6] = IGNORE_INDEX  # a prompt
    labels[2] = IGNORE_INDEX  # a row with nothing to learn
    if masked == "all":
        labels[:] = IGNORE_INDEX
    expected = plain_loss(hidden, weight, bias, labels)
    expected.backward()
    reference = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    batch = collate([{"input_ids": torch.zeros(11, dtype=torch.long), "labels": labels[i], "id": torch.tensor(i)} for i in range(3)], 0)
    got = fused.target_loss(hidden, weight, bias, batch["targets"]["index"], batch["targets"]["labels"])
    (2.5 * got).backward()  # a scaled loss, as the loop scales it
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip((hidden.grad, weight.grad, bias.grad), reference):
        torch.testing.assert_close(ours, 2.5 * theirs, rtol=1e-5, atol=1e-5)  # fp32 sums in another order


def samples(lengths, prompt=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(5, 300, (n,), generator=generator)
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX  # masked prompt, as instruction data has it
        out.append({"input_ids": ids, "labels": labels, "id": torch.tensor(i)})
    return out


def module(tiny_dir, lora=None, attention="litft_segments"):
    config = load_config(str(tiny_dir))
    quantized = lora is not None and lora.quantize is not None
    model = build_model(config, "32-true", lora, False, source=str(tiny_dir), device=torch.device("cpu"), attention=attention)
    lm = CausalLM(model, TrainArgs(), next_token())
    if not quantized:
        Materializer(lm.model, lm.hf_model, CheckpointWeights(tiny_dir), seed=0)(lm)
    return lm.train()


@pytest.mark.parametrize("job", ["full", "lora", "qlora"])
def test_padding_free_batches_equal_padded_ones(tiny_dir, job):
    """The same samples end to end in one row or right-padded: equal summed loss and gradients (fp32)."""
    lora = {"full": None, "lora": LoraArgs(4, 8, 0.0, "all-linear"), "qlora": LoraArgs(4, 8, 0.0, "all-linear", "bnb.nf4")}[job]
    torch.manual_seed(0)
    lm = module(tiny_dir, lora)
    assert fused.fused_head(lm.hf_model) is not None  # the head computes the loss on targets
    batch = samples([9, 4, 13, 6])
    results = []
    for padding_free in (False, True):
        lm.zero_grad()
        collated = collate(batch, pad_id=0, padding_free=padding_free)
        loss = lm.training_step(collated)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}))
    (padded, padded_grads), (free, free_grads) = results
    assert collate(batch, 0, padding_free=True)["input_ids"].shape == (1, 32)
    torch.testing.assert_close(free, padded, rtol=1e-5, atol=1e-5)
    assert padded_grads.keys() == free_grads.keys() and padded_grads
    for name in padded_grads:
        torch.testing.assert_close(free_grads[name], padded_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_fused_loss_equals_the_models_own_head(tiny_dir):
    """The step's loss through the fused head equals cross-entropy over the model's own logits."""
    lm = module(tiny_dir, attention="sdpa")
    batch = collate(samples([7, 12]), pad_id=0)
    ours = lm.training_step(batch)
    logits = lm(batch["input_ids"], batch["position_ids"])
    assert logits.shape[-1] == lm.hf_model.config.vocab_size  # outside a step the head is the head
    predicted = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    expected = F.cross_entropy(logits.flatten(0, 1).float(), predicted.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)
