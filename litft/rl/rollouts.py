"""Rollouts for online RL: completions sampled by the model as it trains, scored, and served to the loop as micro-batches.

The engine is an interface (``Engine.sample``) so that another one (vLLM) can come later
without touching the loop; the first is transformers' ``generate`` on the trained weights,
through litft.model.generation under every strategy (every rank making the same number of
forwards, ``synced_gpus``), in eval mode. Rollouts are a function of (seed, epoch, step,
prompt index) and never of the rank layout: each completion draws its tokens from
uniforms hashed from those numbers (litft.model.generation.Sampler), whichever prompts share
its batch, so two ranks sample what one process samples, and a resumed run samples what
the uninterrupted one did. A step's prompts are cut into runs of ``generation_batch``
in their global order, each run's groups sampled together on one rank; the batch's
width and padding can still move a logit in its last bits, which changes a token only
where a uniform falls that close to a boundary of the cumulative probabilities.
"""

import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from litft.data.collate import collate, sequence_of
from litft.data.order import SampleOrder
from litft.data.prompts import columns_of, reward_view
from litft.data.samples import IGNORE_INDEX
from litft.errors import LitftError
from litft.rl.engine import TransformersEngine
from litft.rl.vllm_engine import VLLMEngine, kv_cache_gib, served_weights
from litft.rl.rewards import group_advantages, score_completions, weighted_sum

ROLLOUTS_FILE = "rollouts.pt"  # a cycle's rollouts in a checkpoint cut inside it (--objective.iterations above 1)


def rollout_seed(seed: int, epoch: int, cycle: int, prompt: int) -> int:
    return int(hashlib.sha256(f"{seed}:{epoch}:{cycle}:{prompt}".encode()).hexdigest()[:15], 16)


def judge(tokenizer, objective, scored: List[Tuple[dict, List[List[int]]]]) -> Tuple[Dict[str, list], List[float]]:
    """Each function's value and the weighted reward of every completion of each (prompt sample, its completions' ids),
    in order, called as TRL calls reward functions (a conversation's prompt and completion as messages, the other columns
    by name)."""
    prompts, completions, ids, columns = [], [], [], {}
    for sample, sampled in scored:
        text, extra = tokenizer.decode(sample["input_ids"], skip_special_tokens=True), columns_of(sample)
        for completion in sampled:
            prompt, completion_text = reward_view(sample, text, tokenizer.decode(completion, skip_special_tokens=True))
            prompts.append(prompt)
            completions.append(completion_text)
            ids.append(completion)
            for key, value in extra.items():
                columns.setdefault(key, []).append(value)
    if not ids:
        return {}, []
    by_function = score_completions(objective.rewards, objective.weights, prompts, completions, ids, columns)
    return by_function, weighted_sum(by_function, objective.weights)


def gather(fabric, value):
    """Every rank's ``value``, in rank order (just this one's in one process)."""
    if fabric.world_size == 1:
        return [value]
    out = [None] * fabric.world_size
    dist.all_gather_object(out, value)
    return out


class RolloutBatches:
    """The loop's step batches under RL: each cycle's prompts sampled, scored and cut into micro-batches of completions.

    Its dependencies are passed in (``for_run`` takes them from a run), its figures go to the objective, and its own state
    (a cycle's rollouts, while a cycle of several iterations is under way) goes into every checkpoint (``state_dict``).
    """

    def __init__(self, *, objective, engine, generation, lm, prompts, order: SampleOrder, place, tokenizer, fabric, micro_batch_size: int,
                 padding_free: bool, seed: int, rollouts_dir: Path, context_limit: Optional[int] = None,
                 weights: Optional[Callable[[], Iterator]] = None):
        self.objective, self.args, self.engine, self.generation, self.lm = objective, objective.args, engine, generation, lm
        self.weights = weights  # the trained weights, whole, a tensor at a time: what an engine of its own is given each cycle
        self.prompts, self.order, self.place, self.tokenizer, self.fabric = prompts, order, place, tokenizer, fabric
        self.pad = tokenizer.pad_token_id
        self.together = self.args.generation_batch or next(n for n in (16, 8, 4, 2, 1) if order.micro_batch_size % n == 0)
        self.micro_batch_size, self.padding_free, self.seed, self.rollouts_dir = micro_batch_size, padding_free, seed, rollouts_dir
        self.cycle: Optional[Tuple[int, int]] = None
        self.micro: List[dict] = []
        self.stored: dict = {}  # a cycle's rollouts read back from a checkpoint cut inside it
        self.kept: Optional[dict] = None  # this cycle's rollouts, every rank's, while its iterations go on
        self.check_context(context_limit)

    @classmethod
    def for_run(cls, trainer, objective, resumed: Optional[Path]) -> "RolloutBatches":
        """The rollouts of a run: its prompts in seeded order, each rank's share of whole prompts, the engine its plan chose."""
        spec, place = trainer.spec, trainer.context
        per_rank = spec.train.global_batch_size // place.data_world
        order = SampleOrder(len(trainer.data.train), spec.train.global_batch_size, per_rank, place.data_rank, place.data_world, spec.seed)
        lm, strategy = trainer.lm, trainer.strategy
        engine = make_engine(trainer, objective, per_rank)
        batches = cls(objective=objective, engine=engine, generation=trainer.generation, lm=lm, prompts=trainer.data.train,
                      order=order, place=place, tokenizer=trainer.tokenizer, fabric=trainer.fabric,
                      micro_batch_size=spec.train.micro_batch_size, padding_free=trainer.padding_free, seed=spec.seed,
                      rollouts_dir=spec.out_dir / "rollouts", context_limit=getattr(trainer.config, "max_position_embeddings", None),
                      weights=lambda: served_weights(lm.hf_model, strategy.whole_weights(lm)))
        stored = resumed / ROLLOUTS_FILE if resumed is not None else None
        if stored is not None and stored.is_file():
            batches.load_state_dict(torch.load(stored, weights_only=True))
        trainer.checkpointer.keep_file(ROLLOUTS_FILE, batches.state_dict)
        return batches

    def state_dict(self) -> Optional[dict]:
        """What a checkpoint cut inside a cycle of iterations keeps: the cycle's rollouts with their sampler log-probs."""
        return self.kept

    def load_state_dict(self, state: dict) -> None:
        self.stored = state

    def check_context(self, limit: Optional[int]) -> None:
        """Refuse, before the first step, a prompt whose completions could run past the model's context."""
        longest = max(range(len(self.prompts)), key=lambda i: len(self.prompts[i]["input_ids"]), default=None)
        if limit is None or longest is None:
            return
        length = len(self.prompts[longest]["input_ids"])
        if length + self.args.max_new_tokens > limit:
            raise LitftError(f"step 0: prompt {int(self.prompts[longest]['id'])} is {length} tokens, and with --objective.max_new_tokens "
                             f"{self.args.max_new_tokens} its completions pass the model's context of {limit}; lower --data.max_seq_length "
                             "(longer prompts are dropped) or --objective.max_new_tokens")

    def position(self, epoch: int, step: int) -> Tuple[int, int]:
        per_epoch = self.order.steps_per_epoch * self.args.iterations
        return (epoch + 1, 0) if step >= per_epoch else (epoch, step)

    def get(self, epoch: int, step: int, run_step: int = 0) -> List[dict]:
        """The micro-batches of the epoch's ``step``, which is the run's ``run_step``."""
        cycle = (epoch, step // self.args.iterations)
        if cycle != self.cycle:
            first_step = run_step - step % self.args.iterations  # where a resumed run re-enters a cycle
            self.cycle, self.micro = cycle, self.roll(*cycle, first_step=first_step)
        return self.micro

    def close(self) -> None:
        pass

    def chunks(self, epoch: int, cycle: int) -> List[List[int]]:
        """This rank's prompts of a cycle in the groups sampled together: the cycle's prompts cut into runs of
        ``generation_batch`` in their global order and dealt out to the ranks in turn (litft.model.generation.deal), so that
        which prompts share a batch (and its padding) does not depend on how many ranks there are."""
        step_prompts = self.order.global_batch_size
        start = cycle * step_prompts
        prompts = self.order.permutation(epoch)[start : start + step_prompts]
        return [[prompts[i] for i in run] for run in self.generation.deal(len(prompts), self.together)]

    def sample(self, epoch: int, cycle: int, chunks: List[List[int]]) -> Tuple[List[dict], float]:
        """Each prompt's group of completions, sampled by the engine in eval mode, and their summed entropy."""
        groups, entropy = [], 0.0
        with self.engine.rollouts():
            for chunk in chunks:
                prompts = [self.prompts[index]["input_ids"].tolist() for index in chunk]
                seeds = [rollout_seed(self.seed, epoch, cycle, index) for index in chunk]
                sampled, chunk_entropy = self.engine.sample(prompts, self.args.group_size, seeds, visuals_of(self.prompts, chunk))
                entropy += chunk_entropy
                groups += [{"completions": [c.tokens for c in group], "cuts": [c.cut for c in group],
                            "logprobs": [c.logprobs for c in group]} for group in sampled]
        return groups, entropy

    def roll(self, epoch: int, cycle: int, first_step: int) -> List[dict]:
        """This rank's rollouts of a cycle as micro-batches: sampled (or read back from the checkpoint), scored, advantaged."""
        args, fabric = self.args, self.fabric
        chunks = self.chunks(epoch, cycle)
        mine = [i for chunk in chunks for i in chunk]
        started = time.perf_counter()
        stored = self.stored.get("groups") if self.stored.get("cycle") == [epoch, cycle] else None
        if stored is not None:
            # Rollouts kept by an earlier litft have no engine log-probs: the sampler's, recomputed then, stand in.
            groups = [{"logprobs": [t.tolist() for t in stored[index]["old_logp"]], **stored[index]} for index in mine]
            entropy = 0.0
        else:
            if not self.engine.shares_weights and self.engine.version != first_step:
                self.engine.sync(self.weights(), first_step)  # the weights of every optimizer step before this cycle
            groups, entropy = self.sample(epoch, cycle, chunks)
            self.engine.sleep()  # a GPU engine's memory back to training until the next cycle
        generation_s = time.perf_counter() - started
        try:
            rewards, by_function = self.score(mine, groups)
        except LitftError as err:
            raise LitftError(f"step {first_step}: {err}") from None
        batch_std = None
        if args.scale_advantages == "batch":
            totals = torch.tensor([rewards.sum(), (rewards ** 2).sum(), rewards.numel()], dtype=torch.float64, device=fabric.device)
            totals = fabric.all_reduce(totals, reduce_op="sum") if fabric.world_size > 1 else totals
            mean = float(totals[0] / totals[2])
            batch_std = max(float(totals[1] / totals[2]) - mean * mean, 0.0) ** 0.5
        advantages = group_advantages(rewards, args.scale_advantages, batch_std)
        samples, per_sample, engine_logps = [], [], []
        for g, (index, group) in enumerate(zip(mine, groups)):
            prompt = self.prompts[index]["input_ids"]
            for j, completion in enumerate(group["completions"]):
                ids = torch.cat([prompt, torch.tensor(completion, dtype=torch.long)])
                labels = torch.cat([torch.full_like(prompt, IGNORE_INDEX), torch.tensor(completion, dtype=torch.long)])
                samples.append({"input_ids": ids, "labels": labels, "id": torch.tensor(index * args.group_size + j)})
                if "images" in self.prompts[index]:  # the prompt's images reach the forward; its text gives the prompt's tokens alone
                    samples[-1].update(text=self.prompts[index]["text"], images=self.prompts[index]["images"], text_tokens=len(prompt))
                per_sample.append(float(advantages[g, j]))
                engine_logps.append(torch.tensor(group["logprobs"][j], dtype=torch.float32))
        micro = []
        for start in range(0, len(samples), self.micro_batch_size):
            batch = collate(samples[start : start + self.micro_batch_size], self.pad, self.padding_free)
            batch["targets"]["sequence"] = sequence_of(batch["targets"]["index"], batch["position_ids"])
            batch["advantage"] = torch.tensor(per_sample[start : start + self.micro_batch_size], dtype=torch.float32)
            # The engine's log-prob of each target token (targets are in sample order, a completion's tokens each), and whether the
            # engine is another module than the trained one (its log-probs then weigh the loss: truncated importance sampling).
            batch["engine_logp"] = torch.cat(engine_logps[start : start + self.micro_batch_size])
            batch["engine_apart"] = not self.engine.shares_weights
            micro.append(batch)
        if args.iterations > 1:
            self.sampler_log_probs(micro, mine, groups, stored)
            self.keep(epoch, cycle, mine, groups, micro)
        if stored is None:  # a cycle read back was logged and written by the run that sampled it
            self.record(first_step, mine, groups, rewards, by_function, advantages, entropy, generation_s)
        return micro

    def score(self, mine: List[int], groups: List[dict]):
        """Each completion's reward (prompts, group), and each function's values, from the reward functions."""
        by_function, total = judge(self.tokenizer, self.objective,
                                   [(self.prompts[index], group["completions"]) for index, group in zip(mine, groups)])
        rewards = torch.tensor(total, dtype=torch.float64).reshape(len(groups), self.args.group_size)
        return rewards, by_function

    @torch.no_grad()
    def sampler_log_probs(self, micro: List[dict], mine: List[int], groups: List[dict], stored) -> None:
        """The completions' log-probs under the policy that sampled them, at the sampling temperature, as the trainer computes
        them (the ratio's denominator for every iteration); their distance from the engine's is logged."""
        lm, fabric = self.lm, self.fabric
        if stored is not None:  # read back with the rollouts: the weights that sampled them are gone
            flat = torch.cat([torch.cat(g["old_logp"]) for g in groups]) if groups else torch.zeros(0)
        else:
            was = lm.training
            lm.eval()
            parts = []
            for batch in micro:
                with fabric.autocast():
                    parts.append(lm.token_log_probs(fabric.to_device(batch), self.args.temperature)[0].float().cpu())
            lm.train(was)
            flat = torch.cat(parts) if parts else torch.zeros(0)
        start = 0
        for batch in micro:
            n = len(batch["targets"]["index"])
            batch["old_logp"] = flat[start : start + n]
            start += n
        if stored is None:
            engine = torch.cat([b["engine_logp"] for b in micro]) if micro else torch.zeros(0)
            self.objective.add_figures(fabric.device, logprob_gap=float((engine - flat).abs().sum()), gap_tokens=float(len(flat)))

    def keep(self, epoch: int, cycle: int, mine: List[int], groups: List[dict], micro: List[dict]) -> None:
        """Every rank's rollouts of the cycle, with their sampler log-probs, in the checkpoints cut inside it."""
        merged = {}
        for part in gather(self.fabric, {index: group for index, group in zip(mine, with_old_logp(groups, micro))}):
            merged.update(part)
        self.kept = {"cycle": [epoch, cycle], "groups": merged}

    def record(self, first_step, mine, groups, rewards, by_function, advantages, entropy, generation_s) -> None:
        """The cycle's figures for the log, and its rollouts in out_dir/rollouts/step-N.jsonl."""
        objective, fabric, tokenizer = self.objective, self.fabric, self.tokenizer
        completions = [c for g in groups for c in g["completions"]]
        cut = sum(sum(g["cuts"]) for g in groups)
        equal = int((rewards.max(dim=1).values == rewards.min(dim=1).values).sum()) if len(groups) else 0
        values = dict(rollout_steps=1.0, prompts=float(len(groups)), completions=float(len(completions)),
                      completion_tokens=float(sum(map(len, completions))), cut=float(cut), equal_groups=float(equal), entropy=entropy,
                      generation_s=generation_s, reward=float(rewards.sum()), reward_sq=float((rewards ** 2).sum()))
        for name, scores in by_function.items():
            judged = [s for s in scores if s is not None]
            values.update({f"{name}/sum": sum(judged), f"{name}/sq": sum(s * s for s in judged), f"{name}/count": float(len(judged))})
        objective.add_figures(fabric.device, **values)
        rows, k = [], 0
        for g, (index, group) in enumerate(zip(mine, groups)):
            prompt_ids = self.prompts[index]["input_ids"].tolist()
            prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
            for j, completion in enumerate(group["completions"]):
                rows.append({"prompt_index": index, "completion_index": j, "prompt": prompt,
                             "completion": tokenizer.decode(completion, skip_special_tokens=True), "cut": group["cuts"][j],
                             "rewards": {name: scores[k] for name, scores in by_function.items()}, "reward": float(rewards[g, j]),
                             "advantage": float(advantages[g, j]), "prompt_ids": prompt_ids, "completion_ids": list(completion),
                             "logprobs": [round(v, 6) for v in group["logprobs"][j]]})
                k += 1
        everyone = gather(fabric, rows)[:: self.place.shared]  # a tensor-parallel group's ranks sampled the same rollouts
        if fabric.is_global_zero:
            folder = self.rollouts_dir
            folder.mkdir(parents=True, exist_ok=True)
            ordered = sorted((r for part in everyone for r in part), key=lambda r: (r["prompt_index"], r["completion_index"]))
            (folder / f"step-{first_step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ordered))


def visuals_of(prompts, indices) -> Optional[list]:
    """The rendered text and image files of each of ``prompts[indices]``, where the prompts see images (else None)."""
    return [(prompts[i]["text"], prompts[i]["images"]) for i in indices] if prompts and "images" in prompts[0] else None


def with_old_logp(groups: List[dict], micro: List[dict]) -> List[dict]:
    """Each group with its completions' sampler log-probs, split back from the micro-batches (targets in sample order)."""
    flat = torch.cat([b["old_logp"] for b in micro]) if micro else torch.zeros(0)
    out, start = [], 0
    for group in groups:
        parts = []
        for completion in group["completions"]:
            parts.append(flat[start : start + len(completion)].clone())
            start += len(completion)
        out.append({**group, "old_logp": parts})
    return out


def held_out_reward(trainer, objective) -> Optional[Dict[str, float]]:
    """The mean reward of one greedy completion of each held-out prompt, every rank its share, and each function's mean."""
    data, fabric = trainer.data, trainer.fabric
    if not data.val:
        return None
    prompts = [sample["input_ids"].tolist() for sample in data.val]
    answers = trainer.generation.greedy(prompts, objective.args.max_new_tokens, trainer.spec.train.micro_batch_size,
                                        visuals_of(data.val, range(len(data.val))))
    scored = [(data.val[i], [answer.tokens]) for i, answer in enumerate(answers) if answer is not None]
    by_function, total = judge(trainer.tokenizer, objective, scored)
    sums = [sum(total), float(len(total))]
    for name in objective.rewards:
        judged = [v for v in by_function.get(name, []) if v is not None]
        sums += [sum(judged), float(len(judged))]
    reduced = torch.tensor(sums, dtype=torch.float64, device=fabric.device)
    reduced = fabric.all_reduce(reduced, reduce_op="sum") if fabric.world_size > 1 else reduced
    values = reduced.tolist()
    out = {"val_reward": values[0] / max(values[1], 1.0)}
    for k, name in enumerate(objective.rewards):
        out[f"val_reward/{name}"] = values[2 + 2 * k] / max(values[3 + 2 * k], 1.0)
    return out


def make_engine(trainer, objective, per_rank: int):
    """The rollout engine the run plan chose: transformers' generate on the trained module, or vLLM in this rank's process."""
    args = objective.args
    if trainer.plan.engine != "vllm":
        return TransformersEngine(trainer.generation, args.max_new_tokens, args.temperature, args.top_p)
    from litft.model.loading import resolve_model

    longest = max(len(sample["input_ids"]) for sample in trainer.data.train)
    max_model_len = longest + args.max_new_tokens
    together = args.generation_batch or next(n for n in (16, 8, 4, 2, 1) if per_rank % n == 0)
    itemsize = torch.tensor([], dtype=trainer.plan.compute_dtype).element_size()
    return VLLMEngine(model=resolve_model(trainer.spec.model), stops=trainer.generation.stops, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, max_model_len=max_model_len, dtype=trainer.plan.compute_dtype,
                      device=trainer.fabric.device, memory=args.vllm_memory,
                      kv_cache_gib=kv_cache_gib(trainer.config, together * args.group_size, max_model_len, itemsize),
                      world_size=trainer.fabric.world_size, rank=trainer.fabric.global_rank, local_rank=trainer.fabric.local_rank)
