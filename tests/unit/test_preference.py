"""Preference objectives against an independent reference: each pair run on its own through transformers' eager forward,
log-probs from full logits, the losses written out from the papers' formulas; packed pairs, the target-only head, the
adapter-off reference and the precomputed one must give the same loss (1e-6) and gradients (1e-5)."""

import copy
import json
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from litft.objectives.args import ObjectiveArgs
from litft.config import TrainArgs
from litft.data.collate import collate
from litft.data.samples import IGNORE_INDEX
from litft.data.preference import Preferences, TinyPreferences, preference_records
from litft.errors import LitftError
from litft.model.loss import TargetLogProbs, fuse_target_loss
from litft.model.causal_lm import CausalLM
from litft.parallel.context import slice_batch
from litft.objectives import build_objective
from litft.objectives.preference import figures_of

PAIRS = 6


@pytest.fixture(scope="module")
def pairs(tokenizer):
    return TinyPreferences(num_train=PAIRS, num_val=0).tokenize(tokenizer, seed=3).train


def independent_loss(objective: ObjectiveArgs, pc, pr, rc, rr, nc, nr):
    """One pair's loss from the papers' formulas, written apart from litft.objectives.preference (sigmoid and log, not logsigmoid)."""
    beta, eps, sig = objective.effective_beta, objective.label_smoothing, torch.sigmoid
    if objective.name == "dpo":
        x = beta * ((pc - pr) - (rc - rr))
        return -(1 - eps) * torch.log(sig(x)) - eps * torch.log(sig(-x))
    if objective.name == "ipo":
        return ((pc / nc - pr / nr) - (rc / nc - rr / nr) - 1 / (2 * beta)) ** 2
    if objective.name == "simpo":
        x = beta * (pc / nc - pr / nr) - objective.gamma
        return -(1 - eps) * torch.log(sig(x)) - eps * torch.log(sig(-x))
    odds = lambda m: torch.exp(m) / (1 - torch.exp(m))  # noqa: E731
    return -pc / nc - beta * torch.log(sig(torch.log(odds(pc / nc)) - torch.log(odds(pr / nr))))


def response_log_prob(model, prompt, response):
    """Summed log-probs of ``response`` after ``prompt``, from one unpadded forward's full logits, and its length."""
    ids = torch.cat([prompt, response])[None]
    logits = model(input_ids=ids).logits[0].float()
    logps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logps.gather(1, response[:, None]).sum(), len(response)


def split_pair(sample):
    labels, ids, start = sample["labels"], sample["input_ids"], int(sample["rejected_start"])
    prompt_len = int((labels[:start] == IGNORE_INDEX).sum())
    return ids[:prompt_len], ids[prompt_len:start], ids[start + prompt_len :]


def independent_figures(objective, pc, pr, rc, rr, nc, nr):
    """What the log shows for one pair (TRL's conventions): each response's implicit reward, and the log-probs compared.

    DPO: beta times the summed log-prob's gain over the reference; IPO the same per token; SimPO and ORPO, which have no
    reference, beta times the mean log-prob. The log-probs are the summed ones for DPO, the per-token means otherwise.
    """
    beta = objective.effective_beta
    if objective.name == "dpo":
        return beta * (pc - rc), beta * (pr - rr), pc, pr
    if objective.name == "ipo":
        return beta * (pc - rc) / nc, beta * (pr - rr) / nr, pc / nc, pr / nr
    return beta * pc / nc, beta * pr / nr, pc / nc, pr / nr


def independent_mean(objective, policy, reference, pairs):
    """The mean loss over the pairs, and the mean of each logged figure."""
    losses, figures = [], []
    for sample in pairs:
        prompt, chosen, rejected = split_pair(sample)
        pc, nc = response_log_prob(policy, prompt, chosen)
        pr, nr = response_log_prob(policy, prompt, rejected)
        if objective.uses_reference:
            with torch.no_grad():
                rc, _ = response_log_prob(reference, prompt, chosen)
                rr, _ = response_log_prob(reference, prompt, rejected)
        else:
            rc = rr = None
        losses.append(independent_loss(objective, pc, pr, rc, rr, nc, nr))
        with torch.no_grad():
            chosen_reward, rejected_reward, logp_chosen, logp_rejected = (float(v) for v in independent_figures(objective, pc, pr, rc, rr, nc, nr))
        figures.append({"reward_chosen": chosen_reward, "reward_rejected": rejected_reward, "reward_margin": chosen_reward - rejected_reward,
                        "preference_accuracy": float(chosen_reward > rejected_reward), "logp_chosen": logp_chosen, "logp_rejected": logp_rejected})
    return torch.stack(losses).mean(), {key: sum(f[key] for f in figures) / len(figures) for key in figures[0]}


def models(tiny_dir, lora: bool):
    """The trained model (LoRA with non-zero adapters, so that policy and reference differ) and its reference, eager attention."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager", dtype=torch.float32)
    if not lora:
        reference = copy.deepcopy(base)
        with torch.no_grad():
            for p in base.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        return base, reference, base
    reference = copy.deepcopy(base)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    return policy, reference, policy


def litft_lm(policy, fused: bool, objective):
    hf = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    hf.set_attn_implementation("sdpa")
    if fused:
        assert fuse_target_loss(hf)
    return CausalLM(policy, TrainArgs(), build_objective(objective, lora=hasattr(policy, "disable_adapter"))).train()


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad and p.grad is not None}


CASES = [
    ("dpo", True, True, True), ("dpo", False, True, False), ("dpo", False, False, True), ("ipo", True, True, True),
    ("simpo", False, True, True), ("simpo", True, False, False), ("orpo", False, True, True), ("orpo", True, True, False),
]


@pytest.mark.parametrize("name,lora,fused,padding_free", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_objective_matches_an_independent_reference(name, lora, fused, padding_free, tiny_dir, pairs, tokenizer):
    objective = ObjectiveArgs(name=name, label_smoothing=0.1 if name in ("dpo", "simpo") and not lora else 0.0)
    policy, reference, trained = models(tiny_dir, lora)
    expected, expected_figures = independent_mean(objective, trained, reference, pairs)
    expected.backward()
    want = grads(trained)
    trained.zero_grad()

    lm = litft_lm(policy, fused, objective)
    samples = [dict(s) for s in pairs]
    if objective.uses_reference and not lora:  # full fine-tuning: the reference scored before training, carried by the pairs
        ref_lm = CausalLM(reference, TrainArgs(), build_objective(objective, lora=False)).eval()
        with torch.no_grad():
            table = ref_lm.predict_step(collate(samples, tokenizer.pad_token_id, padding_free=True))
        for sample, row in zip(samples, table):
            sample["reference"] = row
    batch = collate(samples, tokenizer.pad_token_id, padding_free=padding_free)
    assert lm.objective.count(batch) == PAIRS
    loss = lm.training_step(batch) / PAIRS
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * max(1.0, abs(expected.item())), (loss.item(), expected.item())
    got = grads(trained)
    assert got.keys() == want.keys() and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=key)
    figures = lm.objective.take_figures()
    assert figures[0] == PAIRS and lm.objective.take_figures() is None
    logged = figures_of(figures)
    assert logged.keys() == expected_figures.keys()
    for key, value in expected_figures.items():  # what metrics.csv shows, against the figures computed apart
        assert abs(logged[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, logged[key], value)


@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_target_log_probs_match_full_logits_and_their_gradients(scale):
    """Also with the logits scaled (RL scores at the sampling temperature: one over it)."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    upstream = torch.randn(37, dtype=torch.float64)
    out = TargetLogProbs.apply(hidden, weight, bias, targets, 8, scale)  # chunks of 8 rows
    (out.double() * upstream).sum().backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    want_out = torch.log_softmax((hidden @ weight.T + bias) * scale, dim=-1).gather(1, targets[:, None]).squeeze(1)
    (want_out * upstream).sum().backward()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-6, atol=1e-6)
    for g, t in zip(got, (hidden, weight, bias)):
        torch.testing.assert_close(g, t.grad, rtol=1e-6, atol=1e-6)


def test_target_log_probs_recompute_under_the_forwards_autocast():
    """Under bf16 autocast, bf16 hidden states meet an fp32 head weight (bf16-mixed): the backward computes the logits as the
    forward did (outside the autocast it would fail on the mixed dtypes), and the gradients are autograd's to bf16 rounding."""
    torch.manual_seed(0)
    hidden = torch.randn(21, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets, upstream = torch.randint(0, 40, (21,)), torch.randn(21)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = TargetLogProbs.apply(hidden, weight, None, targets, 8)
        want = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
    torch.autograd.backward(out, upstream)
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    torch.autograd.backward(want, upstream)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0], hidden.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1], weight.grad, rtol=2e-2, atol=2e-2)


def test_a_pair_is_one_sample_of_two_sequences(tokenizer, pairs):
    sample = pairs[0]
    prompt, chosen, rejected = split_pair(sample)
    assert len(sample["input_ids"]) == 2 * len(prompt) + len(chosen) + len(rejected)
    start = int(sample["rejected_start"])
    assert sample["position_ids"][start] == 0 and torch.equal(sample["input_ids"][start : start + len(prompt)], prompt)
    assert chosen[-1] == rejected[-1] == tokenizer.eos_token_id  # text responses end with EOS
    batch = collate(pairs[:3], tokenizer.pad_token_id, padding_free=True)
    sequence = batch["targets"]["sequence"]
    assert sequence.unique().tolist() == list(range(6)) and batch["pairs"] == 3
    # Under context parallel each slice keeps its targets' sequences, and one rank of the group counts the pairs.
    halves = [slice_batch(batch, place, 2) for place in (0, 1)]
    assert torch.equal(torch.cat([h["targets"]["sequence"] for h in halves]), sequence)
    objective = build_objective(ObjectiveArgs(name="dpo"), lora=True)
    assert [objective.count(h) for h in halves] == [3, 0]


def test_tiny_preferences_reject_a_near_miss():
    records = preference_records(40, seed=0)
    assert all(r["chosen"] != r["rejected"] for r in records)
    assert all(len(r["chosen"].split()) == len(r["rejected"].split()) for r in records)


def write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_preference_records_as_text_messages_and_conversations(tmp_path, tokenizer):
    user = [{"role": "user", "content": "Say yes."}]
    records = [
        {"prompt": "Q: 2+2?\nA: ", "chosen": "4", "rejected": "5"},
        {"prompt": user, "chosen": [{"role": "assistant", "content": "yes"}], "rejected": [{"role": "assistant", "content": "no"}]},
        {"chosen": user + [{"role": "assistant", "content": "yes"}], "rejected": user + [{"role": "assistant", "content": "no"}]},
    ]
    data = Preferences(path=write(tmp_path / "p.jsonl", records), val_split_fraction=0.0)
    train = data.tokenize(tokenizer, seed=0).train
    assert len(train) == 3
    # The message forms render the same chat: the two spellings give the same sample.
    assert torch.equal(train[1]["input_ids"], train[2]["input_ids"]) and torch.equal(train[1]["labels"], train[2]["labels"])
    chat = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(split_pair(train[1])[0]) == chat


def test_preference_datasets_through_the_datasets_library_with_renamed_columns(tmp_path, tokenizer):
    """A parquet file read by ``datasets``; Anthropic-HH-style whole texts, whose shared start is the prompt."""
    from datasets import Dataset

    rows = [{"question": "Q: 2+2?\nA: ", "good": "4", "bad": "5"}, {"question": "Q: 1+1?\nA: ", "good": "2", "bad": "3"}]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "pairs.parquet"))
    data = Preferences(path=str(tmp_path / "pairs.parquet"), columns={"prompt": "question", "chosen": "good", "rejected": "bad"}, val_split_fraction=0.0)
    data.check()
    train = data.tokenize(tokenizer, seed=0).train
    assert len(train) == 2 and tokenizer.decode(split_pair(train[0])[0]) == "Q: 2+2?\nA: "
    hh = {"chosen": "Human: say yes\n\nAssistant: yes", "rejected": "Human: say yes\n\nAssistant: no"}
    prompt, chosen, rejected = data.texts(tokenizer, hh, "record 0")
    assert prompt == "Human: say yes\n\nAssistant: " and chosen.startswith("yes") and rejected.startswith("no")
    # Responses that share their first letters still begin with whole words.
    hh = {"chosen": "Human: well?\n\nAssistant: I think so", "rejected": "Human: well?\n\nAssistant: I'm sure"}
    assert data.texts(tokenizer, hh, "record 0")[0] == "Human: well?\n\nAssistant: "


def test_an_empty_prompt_is_one_line(tmp_path, tokenizer):
    """Without a BOS token (litft-tiny has none), an empty prompt would leave the first response token unscored."""
    data = Preferences(path=str(write(tmp_path / "p.jsonl", [{"prompt": "", "chosen": "a", "rejected": "b"}])), val_split_fraction=0.0)
    with pytest.raises(LitftError, match="record 0 of .* has an empty prompt"):
        data.tokenize(tokenizer, seed=0)


def test_truncation_keeps_the_prompt_and_reports(tmp_path, tokenizer):
    long = " ".join(["word"] * 40)
    records = [{"prompt": "short ", "chosen": long, "rejected": "no"}, {"prompt": long, "chosen": "a", "rejected": "b"}]
    data = Preferences(path=write(tmp_path / "p.jsonl", records), val_split_fraction=0.0, max_seq_length=20)
    prepared = data.tokenize(tokenizer, seed=0)
    assert len(prepared.train) == 1
    prompt, chosen, rejected = split_pair(prepared.train[0])
    assert len(prompt) + len(chosen) == 20 and tokenizer.decode(prompt).startswith("short")
    assert prepared.notes and "1 of 2 pairs had responses cut" in prepared.notes[0] and "1 dropped" in prepared.notes[0]


@pytest.mark.parametrize("record,message", [
    ({"prompt": "p", "chosen": "a"}, "record 1 of .* lacks the field\\(s\\) rejected"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "record 1 of .*: 'chosen' is empty"),
    ({"chosen": "a", "rejected": "b"}, "record 1 of .* has no 'prompt' and its two texts share no prompt"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "record 1 of .*: 'chosen' must be text"),
])
def test_a_bad_record_is_one_line_naming_it(tmp_path, record, message, tokenizer):
    data = Preferences(path=write(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}, record]), val_split_fraction=0.0)
    with pytest.raises(LitftError, match=message) as err:
        records, _, origin = data.records(seed=0)
        for number, r in enumerate(records):
            data.texts(tokenizer, r, f"record {number} of {origin}")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change,message", [
    (dict(name="simpo", precompute_reference=True), "uses no reference model"),
    (dict(name="orpo", label_smoothing=0.1), "applies to dpo and simpo"),
    (dict(name="dpo", beta=0.0), "--objective.beta must be positive"),
])
def test_impossible_objective_flags_are_one_line(change, message):
    with pytest.raises(LitftError, match=message):
        ObjectiveArgs(**change).check()
    assert ObjectiveArgs(name="dpo").reference_precomputed(lora=False) and not ObjectiveArgs(name="dpo").reference_precomputed(lora=True)
    assert math.isclose(ObjectiveArgs(name="simpo").effective_beta, 2.0)


def test_estimate_counts_both_sequences_of_a_pair_and_names_the_reference(tiny_dir):
    from litft.estimate import memory_plan, render

    common = dict(model=str(tiny_dir), seq_len=256, train=TrainArgs(micro_batch_size=2))
    sft = memory_plan(job="finetune_lora", **common)
    dpo = memory_plan(job="finetune_lora", objective=ObjectiveArgs(name="dpo"), **common)
    full = memory_plan(job="finetune_full", objective="dpo", **common)
    assert 1.8 < dpo["activations"]["saved"] / sft["activations"]["saved"] < 2.2  # two sequences per pair
    assert "adapter off" in dpo["reference"] and "no reference weights" in full["reference"]
    assert "objective dpo: 2 pairs per micro-batch" in render(dpo)
    with pytest.raises(LitftError, match="use finetune_lora or finetune_full"):
        memory_plan(job="pretrain", objective="orpo", **common)


def test_mfu_counts_the_reference_forward_of_an_adapter_off_reference(tiny_dir):
    from litft.config import LoraArgs
    from litft.model.flops import StepFlops, flops_per_token
    from litft.model.loading import load_config

    config, cpu = load_config(str(tiny_dir)), torch.device("cpu")
    plain = StepFlops.for_run(config, LoraArgs(), "32-true", cpu)
    with_reference = StepFlops.for_run(config, LoraArgs(), "32-true", cpu, reference_forwards=1)
    for n in (17, 300):
        assert with_reference.of_row(n) == pytest.approx(plain.of_row(n) + n * flops_per_token(config, n, trained="forward"), rel=1e-9)


def test_objective_by_name_on_the_command_line_and_its_default_data():
    from litft.__main__ import default_data_named, objective_named

    argv = objective_named(["finetune_lora", "--objective", "dpo", "--objective.beta", "0.2", "--data.num_train", "64"])
    assert argv[:5] == ["finetune_lora", "--objective.name", "dpo", "--objective.beta", "0.2"]
    assert default_data_named(argv)[-4:-2] == ["--data", "TinyPreferences"]
    assert objective_named(["finetune_full", "--objective=orpo"]) == ["finetune_full", "--objective.name", "orpo"]
    assert objective_named(["finetune_full", "--objective", "my/objective.yaml"]) == ["finetune_full", "--objective", "my/objective.yaml"]
    assert default_data_named(["finetune_lora", "--data.num_train", "64"])[1:3] == ["--data", "TinyTasks"]


@pytest.mark.parametrize("name", ["mistral (window)", "qwen3-moe", "gemma2"])
def test_preference_loss_on_other_architectures_matches_transformers_eager(name, pairs, tokenizer, tmp_path):
    """A sliding window, a MoE (grouped experts against transformers' per-expert loop) and Gemma 2 (softcapping, tied
    embeddings, the model's own head): SimPO from litft's packed pairs against each pair alone through transformers' eager
    forward, loss 1e-6 and every gradient 1e-5."""
    from transformers import AutoModelForCausalLM

    from tests.architectures import ARCHITECTURES, as_litft_builds_it, save_tiny

    folder = save_tiny(next(a for a in ARCHITECTURES if a.name == name), tmp_path / "model")
    objective = ObjectiveArgs(name="simpo")
    try:
        eager = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    except TypeError:
        eager = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    expected, _ = independent_mean(objective, eager.train(), None, pairs)
    expected.backward()
    lm = as_litft_builds_it(folder)
    lm.objective = build_objective(objective, lora=False)
    loss = lm.training_step(collate(pairs, tokenizer.pad_token_id, padding_free=True)) / PAIRS
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * max(1.0, abs(expected.item())), (loss.item(), expected.item())
    want = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in lm.model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=key)


def test_under_context_parallel_every_slice_adds_its_share_of_the_router_balance():
    """As a supervised run's slices do: two slices of the same pairs together weigh the router's loss by the pairs once,
    while only the lead slice counts the preference loss itself (the objective's count); a stand-in adds nothing."""
    weights = []

    class Routed:
        model = None

        def token_log_probs(self, batch):
            return torch.zeros(len(batch["targets"]["sequence"]), requires_grad=True), torch.tensor(0.5)

        def with_router_aux(self, loss, aux, weight):
            weights.append(weight)
            return loss + aux * weight

    objective = build_objective(ObjectiveArgs(name="simpo"), lora=False)  # reference-free: no second forward
    targets = {"sequence": torch.tensor([0, 1, 2, 3]), "index": torch.arange(4), "labels": torch.zeros(4, dtype=torch.long)}
    batch = {"ids": torch.tensor([0, 1]), "pairs": 2, "targets": targets}
    for lead in (True, False):
        objective.loss_sum(Routed(), {**batch, "lead_slice": lead, "slices": 2})
    objective.loss_sum(Routed(), {**batch, "counted": False})
    assert weights == [1.0, 1.0, 0]
    assert [objective.count({**batch, "lead_slice": lead, "slices": 2}) for lead in (True, False)] == [2, 0]
