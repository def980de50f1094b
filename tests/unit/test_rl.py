"""GRPO and its variants against implementations written apart from litft, from the papers' formulas, on the same rollouts.

DeepSeekMath (GRPO): per completion the token mean of min(r A, clip(r) A), then the mean over completions; DAPO: one
token mean over every completion token of the batch, the clip's upper edge of its own; Dr. GRPO: unscaled advantages and
sums over a constant length; GSPO: one ratio per completion, exp of the mean token log-ratio. KL: k3 = e^(ref - logp) -
(ref - logp) - 1.
"""

import contextlib
import math
import statistics

import pytest
import torch

from litft.objectives.args import ObjectiveArgs
from litft.errors import LitftError
from litft.objectives import build_objective
from litft.rl.rewards import exact_match, format_reward, load_rewards, score_completions, weighted_sum
from litft.rl.rewards import group_advantages

EPS = 1e-4


def paper_advantages(rewards, scale):
    groups = [list(map(float, row)) for row in rewards]
    flat = [r for row in groups for r in row]
    batch_std = statistics.pstdev(flat) if scale == "batch" else None
    out = []
    for row in groups:
        mean = sum(row) / len(row)
        if scale == "group":
            out.append([(r - mean) / (statistics.stdev(row) + EPS) for r in row])
        elif scale == "batch":
            out.append([(r - mean) / (batch_std + EPS) for r in row])
        else:
            out.append([r - mean for r in row])
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_follow_the_papers(scale):
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [2.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    flat = rewards.flatten()
    batch_std = float(((flat - flat.mean()) ** 2).mean().sqrt())
    got = group_advantages(rewards, scale, batch_std if scale == "batch" else None, eps=EPS)
    torch.testing.assert_close(got, torch.tensor(paper_advantages(rewards.tolist(), scale), dtype=torch.float64), rtol=0, atol=1e-12)


def paper_loss(logps, olds, refs, advantages, args):
    """The batch's loss from the formulas: lists per completion of token tensors (logp with gradient), in plain loops."""
    low, high = args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon
    beta = args.effective_beta
    per_completion, tokens = [], 0
    for logp, old, ref, a in zip(logps, olds, refs, advantages):
        terms = []
        seq_ratio = torch.exp(sum(l - o for l, o in zip(logp, old)) / len(logp))
        for t in range(len(logp)):
            ratio = seq_ratio if args.importance == "sequence" else torch.exp(logp[t] - old[t])
            term = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - low, 1 + high) * a)
            if beta > 0:
                d = ref[t] - logp[t]
                term = term + beta * (torch.exp(d) - d - 1)
            terms.append(term)
        per_completion.append(terms)
        tokens += len(terms)
    if args.loss_norm == "token":
        return sum(sum(t) for t in per_completion) / tokens
    if args.loss_norm == "sequence":
        return sum(sum(t) / len(t) for t in per_completion) / len(per_completion)
    return sum(sum(t) for t in per_completion) / (len(per_completion) * args.max_new_tokens)


VARIANTS = {
    "grpo": dict(loss_norm="sequence", scale_advantages="group"),
    "dapo": dict(loss_norm="token", scale_advantages="group", epsilon_high=0.28),
    "dr-grpo": dict(loss_norm="constant", scale_advantages="none", max_new_tokens=9),
    "gspo": dict(loss_norm="sequence", importance="sequence", epsilon=3e-4, epsilon_high=4e-4),
    "kl": dict(loss_norm="token", beta=0.04),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("iterations", [1, 2])
def test_each_variant_gives_the_papers_loss_and_gradients(variant, iterations):
    """On the same rollouts, through the objective's own loss_sum and the loop's division by the batch's count: the loss
    1e-6 and the gradients 1e-5 of the formulas. With iterations 2 the sampler's log-probs differ from the policy's by up
    to 0.5, so the clip is active for some tokens (asserted)."""
    args = ObjectiveArgs(name="grpo", iterations=iterations, temperature=0.7, **VARIANTS[variant])
    objective = build_objective(args, lora=True)
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2, 6]
    logits = torch.randn(sum(lengths), generator=generator, dtype=torch.float64)
    old = (logits - (torch.rand(len(logits), generator=generator, dtype=torch.float64) - 0.5)) if iterations > 1 else None
    reference = logits + 0.1 * torch.randn(len(logits), generator=generator, dtype=torch.float64)
    advantage = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    class FakeLM:
        """What the objective asks of the model: the target tokens' log-probs (the policy's, then the reference's)."""

        model = type("Base", (), {"disable_adapter": staticmethod(contextlib.nullcontext)})()

        def __init__(self, *values):
            self.values = iter(values)

        def token_log_probs(self, batch, temperature=1.0):
            assert temperature == 0.7  # the policy's and the reference's, scored at the sampling temperature
            return next(self.values), None

        def with_router_aux(self, loss, aux, weight):
            return loss

    theirs = logits.clone().requires_grad_()
    split = list(theirs.split(lengths))
    olds = [t.detach() for t in split] if old is None else list(old.split(lengths))
    expected = paper_loss(split, olds, list(reference.split(lengths)), advantage.tolist(), args)
    expected.backward()

    ours = logits.clone().requires_grad_()
    lm = FakeLM(ours, reference)
    batch = {"targets": {"index": torch.arange(len(logits)), "sequence": sequence}, "advantage": advantage}
    if old is not None:
        batch["old_logp"] = old
    loss = objective.loss_sum(lm, batch) / objective.count(batch)
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * max(1.0, abs(expected.item())), (loss.item(), expected.item())
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-8)
    figures = objective.figures(objective.take_figures())
    if iterations > 1:
        assert figures["clip_fraction"] > 0, figures
    if variant == "kl":
        assert figures["kl"] > 0


def test_rewards_take_trls_signature_and_none_leaves_the_sum():
    prompts, completions = ["p"] * 3, ["a b", " x ", "nope"]
    rewards = score_completions({"exact_match": exact_match(), "format": format_reward(r"[a-z ]+")}, [1.0, 0.5], prompts, completions,
                                [[1], [2], [3]], {"answer": ["a b", None, "yes"]})
    assert rewards == {"exact_match": [1.0, None, 0.0], "format": [1.0, 1.0, 1.0]}
    assert weighted_sum(rewards, [1.0, 0.5]) == [1.5, 0.5, 0.5]
    functions = load_rewards(f"exact_match, tests.unit.test_rl:length_reward,{__file__}:length_reward", "x")
    assert list(functions) == ["exact_match", "length_reward"] and functions["length_reward"](None, None, [[1, 2]]) == [2.0]
    # A conversation's prompt and completion reach the functions as TRL gives them: messages, and one assistant message.
    from litft.data.prompts import reward_view

    chat = {"messages": '[{"role": "user", "content": "hi"}]'}
    assert reward_view(chat, "rendered", "a b") == ([{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "a b"}])
    assert reward_view({}, "rendered", "a b") == ("rendered", "a b")
    assert exact_match()(None, [[{"role": "assistant", "content": " a b"}]], None, answer=["a b"]) == [1.0]
    gsm8k = exact_match(r"####\s*(-?[\d,.]+)")  # GSM8K: the answer column's reasoning ends "#### 72", and so should a completion's
    assert gsm8k(None, ["so 70 + 2 = 72.\n#### 72", "#### 7 or #### 71", "72"], None,
                 answer=["Natalia sold 48/2 = 24 clips... 48+24 = 72\n#### 72"] * 3) == [1.0, 0.0, 0.0]
    with pytest.raises(LitftError, match="cannot be imported"):
        load_rewards("nowhere:reward", "x")
    for function, message in [(lambda **kw: [1.0], "returned 1 values for 3 completions"), (lambda **kw: [math.nan] * 3, "returned nan"),
                              (lambda **kw: 1 / 0, "reward bad raised ZeroDivisionError")]:
        with pytest.raises(LitftError, match=message):
            score_completions({"bad": function}, [1.0], prompts, completions, [[1], [2], [3]], {})


CALLS = []


def fails_at_step_3(prompts, completions, completion_ids, **columns):
    CALLS.append(1)
    if len(CALLS) == 3:
        raise ValueError("no answer column today")
    return [float(len(c) % 2) for c in completions]


def test_a_reward_that_fails_mid_run_stops_in_one_line_naming_the_step_and_keeps_the_checkpoint(tmp_path, capsys):
    from litft.__main__ import main
    from litft.checkpoint import complete_checkpoints

    CALLS.clear()
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        main(["finetune_lora", "--objective", "grpo", "--objective.group_size", "2", "--objective.max_new_tokens", "4",
              "--objective.rewards", "tests.unit.test_rl:fails_at_step_3", "--data.num_train", "8", "--data.num_val", "0",
              "--train.global_batch_size", "2", "--train.max_steps", "4", "--train.save_interval", "2", "--eval.interval", "0",
              "--eval.initial_validation", "false", "--accelerator", "cpu", "--logger_name", "csv", "--out_dir", str(out)])
    assert stop.value.code not in (0, None)
    assert "error: step 3: reward fails_at_step_3 raised ValueError: no answer column today\n" in capsys.readouterr().err
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000002"]


def length_reward(prompts, completions, completion_ids, **columns):
    return [float(len(ids)) for ids in completion_ids]


def test_grpo_flags_are_checked_in_one_line():
    for args, message in [
        (dict(group_size=1), "--objective.group_size must be at least 2"),
        (dict(reward_weights=[1.0, 2.0]), "has 2 weights for 1 reward functions"),
        (dict(top_p=0.0), "--objective.top_p"),
        (dict(epsilon=1.0), "--objective.epsilon clips"),
        (dict(answer_pattern="(unclosed"), "--objective.answer_pattern '\\(unclosed' is not a regular expression"),
    ]:
        with pytest.raises(LitftError, match=message):
            ObjectiveArgs(name="grpo", **args).check()
    assert math.isclose(ObjectiveArgs(name="grpo").effective_beta, 0.0)


def test_the_estimate_counts_a_groups_kv_cache_as_generate_holds_it(tiny_dir, capsys):
    """The sampling row of ``litft estimate --objective grpo`` is the KV cache transformers' generate keeps for a call's
    groups (measured on litft-tiny for one), plus the sampler's vocabulary-wide rows; the trace runs the GRPO loss with the
    sampler's log-probs."""
    import json

    from transformers import AutoModelForCausalLM

    from litft.__main__ import main

    group, prompt, new = 4, 10, 6
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    ids = torch.randint(5, 100, (group, prompt))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=True,
                         return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    objective = build_objective(ObjectiveArgs(name="grpo", group_size=group, max_new_tokens=new), lora=True)
    logits = 4 * group * model.config.vocab_size * 4
    # generate does not run the last sampled token through the model: the cache holds one position fewer than the row
    assert objective.generation_bytes(model.config, prompt, 4) - logits == held
    assert objective.generation_bytes(model.config, prompt, 4, prompts=3) - 3 * logits == 3 * held  # a call of three groups

    capsys.readouterr()
    main(["estimate", str(tiny_dir), "--job", "finetune_lora", "--objective", "grpo", "--objective.group_size", "8",
          "--objective.iterations", "2", "--seq_len", "64", "--train.micro_batch_size", "4", "--precision", "32-true", "--json", "true"])
    plan = json.loads(capsys.readouterr().out)
    # 32 prompts a step on one rank (the default global batch): 16 prompts' groups per generate call, each prompt 64 tokens
    expected = build_objective(ObjectiveArgs(name="grpo", group_size=8), lora=True).generation_bytes(model.config, 64, 4, prompts=16)
    assert plan["per_rank"]["generation"]["gpu"] == expected and plan["activations"]["peak"] > 0
    # vLLM holds its share of the device while sampling and its weights on the host while it sleeps through the step
    main(["estimate", str(tiny_dir), "--job", "finetune_lora", "--objective", "grpo", "--objective.engine", "vllm", "--objective.vllm_memory",
          "0.25", "--precision", "bf16-true", "--gpu", "H100", "--json", "true"])
    plan = json.loads(capsys.readouterr().out)
    weights = sum(p.numel() for p in model.parameters()) * 2  # bf16, the adapters merged into the base
    assert plan["engine"] == "vllm" and plan["per_rank"]["generation"]["gpu"] == int(0.25 * plan["device"]["memory"])
    assert plan["per_rank"]["generation"]["cpu"] == weights and plan["total"]["cpu"] >= weights


def test_the_sampler_draws_from_the_softmax_at_the_temperature_with_noise_of_each_rows_own():
    """Inverse CDF on hashed uniforms: first tokens of 40,000 rows fall as softmax(logits / T) says (top-p drops the tail), each
    drawn token's log-prob is log softmax(logits / T) at it (the whole vocabulary, top-p or not), and a row's draws depend on
    its seed alone, not on the rows beside it."""
    from litft.model.generation import Sampler

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    rows = 40_000
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8)):
        sampler = Sampler(list(range(rows)), temperature, top_p, [], "cpu")
        out = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, -1).clone())
        picked = out.argmax(-1)
        assert torch.equal(out.isfinite().sum(-1), torch.ones(rows, dtype=torch.long))  # greedy decoding can take only the draw
        expected = torch.softmax(logits / temperature, -1)
        torch.testing.assert_close(sampler.logps[0], expected.log()[picked], rtol=0, atol=1e-6)
        entropy = -(expected * expected.log()).sum()
        torch.testing.assert_close(sampler.entropy / rows, entropy.double().expand(rows) / rows, rtol=1e-5, atol=0)
        if top_p < 1:  # the smallest set of tokens whose probability reaches top_p: the first two here (0.63 + 0.23)
            expected = torch.where(torch.arange(5) < 2, expected, 0.0)
            expected /= expected.sum()
        share = torch.bincount(picked, minlength=5).double() / rows
        torch.testing.assert_close(share, expected.double(), atol=0.01, rtol=0)  # binomial std at most 0.0025

    seeds = [11, 2**59 + 5, 77]
    together = Sampler(seeds, 1.0, 1.0, [], "cpu")
    alone = Sampler(seeds[1:2], 1.0, 1.0, [], "cpu")
    draws = [], []
    for _ in range(20):  # each token its own uniform, the same for a seed wherever its row is
        scores = torch.randn(3, 50)
        draws[0].append(together(torch.zeros(3, 1, dtype=torch.long), scores.clone()).argmax(-1))
        draws[1].append(alone(torch.zeros(1, 1, dtype=torch.long), scores[1:2].clone()).argmax(-1))
    assert torch.equal(torch.stack(draws[0])[:, 1:2], torch.stack(draws[1]))
    assert not torch.equal(torch.stack(draws[0])[:, 0], torch.stack(draws[0])[:, 2])
    # A token of probability 0 (a -inf logit, or outside top-p) is never drawn, however close the uniform comes to 1.
    edge = Sampler([5], 1.0, 1.0, [], "cpu")
    edge.uniform = lambda: torch.tensor([1.0 - 2**-24])
    assert int(edge(None, torch.tensor([[0.0, 0.0, -math.inf]])).argmax()) == 1
    # Tokens never drawn (a vision-language model's image placeholders) are cut as top-p's tail is, however likely; the
    # log-prob kept is still over the whole vocabulary, as the loss scores it.
    shy = Sampler(list(range(2000)), 1.0, 1.0, [], "cpu", never=[0, 2, 9])  # 9: past this vocabulary, ignored
    out = shy(torch.zeros(2000, 1, dtype=torch.long), logits.expand(2000, -1).clone())
    picked = out.argmax(-1)
    assert not torch.isin(picked, torch.tensor([0, 2])).any() and set(picked.tolist()) == {1, 3, 4}
    torch.testing.assert_close(shy.logps[0], torch.log_softmax(logits, -1)[picked], rtol=0, atol=1e-6)


def test_dealing_gives_every_rank_as_many_calls_and_each_prompt_once():
    from litft.model.generation import deal

    for count, per_call, world in ((10, 4, 2), (3, 4, 2), (16, 4, 4), (0, 2, 2), (7, 1, 3)):
        runs = [deal(count, per_call, rank, world) for rank in range(world)]
        assert len({len(r) for r in runs}) == 1
        dealt = sorted(i for r in runs for run in r for i in run)
        assert dealt == list(range(count))
        assert all(len(run) <= per_call for r in runs for run in r)
    assert deal(10, 4, 0, 2) == [[0, 1, 2, 3], [8, 9]] and deal(10, 4, 1, 2) == [[4, 5, 6, 7], []]


def test_an_engine_apart_from_the_trained_module_weighs_each_token_by_the_capped_ratio():
    """Truncated importance sampling (TRL's vllm_importance_sampling_correction): where another module sampled (vLLM), each
    token's loss is weighed by min(p_trainer / p_engine, cap), detached; the figures give the ratio's mean, max and capped
    share. The transformers engine is the trained module and weighs nothing."""
    args = ObjectiveArgs(name="grpo", loss_norm="token", is_cap=2.0)
    objective = build_objective(args, lora=True)
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    engine = torch.tensor([-1.1, -2.0, -1.5, -2.0])  # ratios exp(0.1), 1, exp(1) (capped at 2), exp(-1)
    advantage = torch.tensor([1.0, -1.0], dtype=torch.float64)
    sequence = torch.tensor([0, 0, 1, 1])

    class FakeLM:
        model = None

        def token_log_probs(self, batch, temperature=1.0):
            return ours, None

        def with_router_aux(self, loss, aux, weight):
            return loss

    weights = torch.exp(logp - engine.double()).clamp(max=2.0)
    for apart in (True, False):
        ours = logp.clone().requires_grad_()
        batch = {"targets": {"index": torch.arange(4), "sequence": sequence}, "advantage": advantage, "engine_logp": engine,
                 "engine_apart": apart}
        loss = objective.loss_sum(FakeLM(), batch)
        loss.backward()
        # At the first iteration the clipped ratio is 1 and its gradient is -A per token: weighted where the engine is apart.
        expected = -advantage[sequence] * (weights if apart else 1.0)
        torch.testing.assert_close(ours.grad, expected, rtol=1e-6, atol=1e-9)
        figures = objective.figures(objective.take_figures(), maxima=objective.take_maxima())
        if apart:
            assert figures["is_ratio_mean"] == pytest.approx(float(torch.exp(logp - engine.double()).mean()))
            assert figures["is_ratio_max"] == pytest.approx(math.e, rel=1e-6) and figures["is_capped_share"] == 0.25
        else:
            assert "is_ratio_mean" not in figures
        assert figures["sampler_logprob_gap"] == pytest.approx(float((logp - engine.double()).abs().mean()), rel=1e-6)


def test_vllm_is_given_a_tied_head_under_its_own_name():
    """named_parameters names a tied head once (as the embedding); vLLM keeps a head it is not given at its placeholder
    values, so the pushed weights name it too (SmolLM2 sampled noise before: a log-prob gap of 3.8 nats)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from litft.rl.vllm_engine import served_weights

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    served = dict(served_weights(model, model.named_parameters()))
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert served["lm_head.weight"] is served["model.embed_tokens.weight"]
    assert served.keys() == model.state_dict().keys()
