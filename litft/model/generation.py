"""Generation for every caller (evaluation's greedy answers, the held-out reward, RL's rollouts): one way of dealing prompts
to ranks, one padding, one generation config, and one sampler.

- **Dealing.** A list of prompts is cut, in its own order, into runs of ``per_call`` prompts, and the runs are dealt to the
  data-parallel ranks in turn. Every rank makes the same number of generate calls (a rank short of runs answers a
  stand-in it does not count), since under FSDP, ZeRO-3, tensor and expert parallel every forward is a collective. The
  ranks of a tensor-parallel or context group take the same runs, as they take the same samples in training.
- **Padding.** Each call's prompts are left-padded, so every completion starts at the same column.
- **Config.** A fresh ``GenerationConfig`` for every call, with the model's own set aside while it runs: transformers
  fills every field a passed config leaves unset from the model's (a ``repetition_penalty`` of 1.05 in Qwen2.5-Instruct,
  ``num_beams``, suppressed tokens), and any of them would make the completions come from another policy than the one
  the loss scores.
- **Mode.** The model generates in eval mode (no dropout, MoE routers as at inference, no expert-load counts) and its
  mode is restored after; compiled blocks run eagerly (each decode step has another shape).
- **Sampling** (``Sampler``): each completion draws its tokens by inverse CDF from a uniform hashed from (its seed, the
  token's position), so a completion depends on its seed alone, not on which other prompts share its batch: two ranks
  sample what one process samples, and a resumed run what the uninterrupted one did. The log-prob of each drawn token at
  the sampling temperature is kept: what the trainer's first forward must give back.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from litft.model.compiling import eager_blocks
from litft.model.vision import has_pixels, image_marker_tokens

MASK32 = 0xFFFFFFFF
Visual = Tuple[str, List[bytes]]  # a prompt that sees images: its rendered text and its image files' bytes (litft.data.images)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each element of an int64 tensor holding values below 2**32 (products wrap; their low 32 bits
    are exact), mixing every input bit into every output bit."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def stop_tokens(model, tokenizer) -> List[int]:
    """The tokenizer's EOS and the model's own end-of-turn tokens (chat models often have several)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({t for t in [tokenizer.eos_token_id, *configured] if t is not None})


def left_padded(prompts: List[List[int]], pad: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one batch padded on the left (every completion starts at the same column), and its attention mask."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long), 1
    return ids, mask


def deal(count: int, per_call: int, rank: int, world: int) -> List[List[int]]:
    """This rank's runs of item indices, one generate call each: ``count`` items cut in order into runs of ``per_call``,
    dealt to the ``world`` ranks in turn; empty runs (stand-ins) pad every rank to the same number of calls."""
    runs = [list(range(start, min(start + per_call, count))) for start in range(0, count, per_call)]
    mine = runs[rank::world]
    return mine + [[] for _ in range(math.ceil(len(runs) / world) - len(mine))]


class Sampler:
    """A logits processor that draws each row's next token from softmax(logits / T), after top-p, by inverse CDF.

    Row r's t-th token takes the first vocabulary entry whose cumulative probability passes u * total, with u a uniform
    hashed from (seeds[r], t): one number per row and token, where Gumbel-max needed one per vocabulary entry (about
    a third of the full-vocabulary passes, none on int64). The processor returns scores that make the drawn token the
    argmax, so greedy decoding takes it. Beside it: each drawn token's log-prob at T over the whole vocabulary (what the
    loss scores; top-p's cut is not in it), and each row's summed entropy at T while it has not stopped.

    ``never``: tokens cut like top-p's tail, whatever their probability: a vision-language model's image placeholders and
    markers (``image_marker_tokens``), which in a completion would make the trainer's forward look for an image that is
    not there (transformers stops: "Image features and image tokens do not match"; vLLM samples them too, in R1-V's runs).
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float, stops: Sequence[int], device, never: Sequence[int] = ()):
        self.temperature, self.top_p = temperature, top_p
        self.never, self.never_at = list(never), None  # never_at: the ids within the vocabulary, on the device (first draw)
        keyed = torch.tensor([[seed & MASK32, (seed >> 32) & MASK32] for seed in seeds], dtype=torch.int64, device=device)
        self.rows = hash32(hash32(keyed[:, 0]) ^ hash32(keyed[:, 1] + 0x9E3779B9))
        self.step = 0
        self.stops = torch.tensor(list(stops) or [-1], device=device)
        self.live = torch.ones(len(seeds), dtype=torch.bool, device=device)
        self.entropy = torch.zeros(len(seeds), dtype=torch.float64, device=device)
        self.logps: List[torch.Tensor] = []  # one (rows,) tensor per generated position

    def uniform(self) -> torch.Tensor:
        """This position's uniform of every row in [0, 1), from 24 hashed bits (exact in float32)."""
        token = hash32(self.rows ^ hash32(self.rows.new_tensor(self.step + 0x85EBCA6B)))
        return (token >> 8).float() / 2**24

    def draw(self, warped: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's drawn token, its log-prob and the row's entropy, from scores already divided by the temperature."""
        norm = torch.logsumexp(warped, dim=-1, keepdim=True)
        probs = (warped - norm).exp_()
        entropy = norm.squeeze(1) - torch.where(probs > 0, probs * warped, 0.0).sum(-1)
        kept = probs if self.top_p >= 1 else top_p_kept(probs, self.top_p)
        if self.never:
            if self.never_at is None:  # once: a boolean index per token would wait on the device at every step
                self.never_at = torch.tensor([t for t in self.never if t < kept.shape[-1]], dtype=torch.long, device=kept.device)
            kept = kept.index_fill(1, self.never_at, 0.0)
        cdf = kept.cumsum_(-1) if kept is not probs else probs.cumsum(-1)
        total = cdf[:, -1:]
        # Strictly below the total: the first entry whose cumulative sum passes it has a probability above 0.
        target = torch.minimum(self.uniform()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        choice = torch.searchsorted(cdf, target, right=True).clamp_(max=warped.shape[-1] - 1)
        return choice, (warped.gather(1, choice) - norm).squeeze(1), entropy

    def __call__(self, input_ids, scores):
        if self.step:  # the token just chosen ends its row
            self.live &= ~torch.isin(input_ids[:, -1], self.stops)
        warped = scores.float() / self.temperature
        choice, logp, entropy = self.draw(warped)
        self.entropy += torch.where(self.live, entropy.double(), 0.0)
        self.logps.append(logp)
        self.step += 1
        return warped.fill_(-math.inf).scatter_(1, choice, 0.0)


def top_p_kept(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The probabilities with every token outside the smallest set reaching ``top_p`` set to 0 (the most likely always kept)."""
    ordered, order = probs.sort(dim=-1, descending=True)
    outside = ordered.cumsum(-1) - ordered >= top_p
    return probs.scatter(1, order, ordered.masked_fill_(outside, 0.0))


@dataclass
class Completion:
    """One generated completion: its tokens (ended by a stop token unless cut), whether it was cut at max_new_tokens, and,
    where it was sampled, each token's log-prob at the sampling temperature."""

    tokens: List[int]
    cut: bool
    logprobs: Optional[List[float]] = None


class Generation:
    """Generation on the weights being trained, for every caller alike (see the module's docstring)."""

    def __init__(self, fabric, module, tokenizer, place, weights=None):
        self.fabric, self.tokenizer, self.place = fabric, tokenizer, place
        self.lm = module.module if hasattr(module, "module") else module
        self.model = self.lm.model
        self.stops = stop_tokens(self.model, tokenizer)
        self.never = image_marker_tokens(self.lm.hf_model.config) if getattr(self.lm, "sees_images", False) else []
        self.weights = weights or contextlib.nullcontext  # the strategy's weights for generation, held for a whole call

    def deal(self, count: int, per_call: int) -> List[List[int]]:
        """This data-parallel rank's runs of ``count`` items (``deal``); every rank makes as many calls."""
        return deal(count, per_call, self.place.data_rank, self.place.data_world)

    @contextlib.contextmanager
    def generating(self):
        """Eval mode, the model's own generation config set aside, compiled blocks eager; restored after."""
        from transformers import GenerationConfig

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        was, kept = self.model.training, base.generation_config
        self.model.eval()
        base.generation_config = GenerationConfig()
        try:
            with torch.no_grad(), self.fabric.autocast(), eager_blocks(), self.weights():
                yield
        finally:
            base.generation_config = kept
            self.model.train(was)

    def config(self, max_new_tokens: int):
        """Greedy decoding of the (processed) scores up to ``max_new_tokens``, stopping at the stop tokens, nothing else."""
        from transformers import GenerationConfig

        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, repetition_penalty=1.0,
                                eos_token_id=self.stops, pad_token_id=self.tokenizer.pad_token_id)

    def call(self, prompts: List[List[int]], max_new_tokens: int, sampler: Optional[Sampler] = None,
             visuals: Optional[List[Visual]] = None) -> List[Completion]:
        """One generate call on left-padded ``prompts`` (inside ``generating``): each row's completion. ``visuals``: each
        prompt's rendered text and image files, for a model that sees images (litft.model.vision.ImageInputs)."""
        device = self.fabric.device
        ids, mask = left_padded(prompts, self.tokenizer.pad_token_id)
        vision = {}
        if visuals is not None:
            vision = self.lm.images.prompts([text for text, _ in visuals], [files for _, files in visuals], ids, mask)
            vision = {key: value.to(device) for key, value in vision.items()}
        stand_in = getattr(self.lm, "stand_in", None)  # a sharded image encoder runs on every rank (litft.model.vision)
        if stand_in is not None and not has_pixels(vision):
            stand_in.before_generate(self.model)
        try:
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=self.config(max_new_tokens),
                                      logits_processor=[sampler] if sampler is not None else None, synced_gpus=self.fabric.world_size > 1,
                                      **vision)
        finally:
            if stand_in is not None:
                stand_in.pending = False
        rows = out[:, ids.shape[1]:].cpu()
        logps = torch.stack(sampler.logps, 1).float().cpu() if sampler is not None and sampler.logps else None
        completions = []
        for r, row in enumerate(rows.tolist()):
            end = next((i + 1 for i, token in enumerate(row) if token in self.stops), None)
            tokens = row if end is None else row[:end]
            completions.append(Completion(tokens, end is None, None if logps is None else logps[r, : len(tokens)].tolist()))
        return completions

    def greedy(self, prompts: List[List[int]], max_new_tokens: int, per_call: int,
               visuals: Optional[List[Visual]] = None) -> List[Optional[Completion]]:
        """The greedy completion of each prompt this rank was dealt (None for the others'), every rank calling alike."""
        out: List[Optional[Completion]] = [None] * len(prompts)
        with self.generating():
            for run in self.deal(len(prompts), per_call):
                run_visuals = None if visuals is None else [visuals[i] for i in run] or visuals[:1]
                answers = self.call([prompts[i] for i in run] or prompts[:1], max_new_tokens, visuals=run_visuals)
                for i, answer in zip(run, answers):
                    out[i] = answer
        return out

    def sample(self, prompts: List[List[int]], count: int, seeds: List[int], max_new_tokens: int, temperature: float,
               top_p: float, visuals: Optional[List[Visual]] = None) -> Tuple[List[List[Completion]], float]:
        """``count`` completions of each prompt, sampled together in one call, and their summed entropy; ``seeds``: one per
        prompt, from which alone its completions are drawn (inside ``generating``)."""
        rows = [seed ^ ((j * 0x9E3779B97F4A7C15) & (2**64 - 1)) for seed in seeds for j in range(count)]  # a seed per completion
        sampler = Sampler(rows, temperature, top_p, self.stops, self.fabric.device, self.never)
        repeated = None if visuals is None else [v for v in visuals for _ in range(count)]
        pieces = self.call([p for p in prompts for _ in range(count)], max_new_tokens, sampler, repeated)
        return [pieces[k * count : (k + 1) * count] for k in range(len(prompts))], float(sampler.entropy.sum())
