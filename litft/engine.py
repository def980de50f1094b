"""What samples completions for online RL: an interface, so that another engine (vLLM) can come later without touching
the loop, and its first implementation, transformers' ``generate`` on the weights being trained."""

from typing import List, Optional, Sequence, Tuple

import torch

from litft.evaluation import stop_tokens


class Entropy:
    """A logits processor that adds up each row's entropy at the sampling temperature while it has not stopped (on the device)."""

    def __init__(self, rows: int, temperature: float, stops: Sequence[int], device):
        self.temperature = temperature
        self.sums = torch.zeros(rows, dtype=torch.float64, device=device)
        self.live = torch.ones(rows, dtype=torch.bool, device=device)
        self.stops = torch.tensor(list(stops), device=device)
        self.started = False

    def __call__(self, input_ids, scores):
        if self.started:  # the token just chosen ends its row
            self.live &= ~torch.isin(input_ids[:, -1], self.stops)
        self.started = True
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
        self.sums += torch.where(self.live, entropy.double(), 0.0)
        return scores


class Engine:
    """What samples completions: ``sample`` gives ``count`` completions (token ids, ended by a stop token unless cut) of each
    of some prompts, sampled together."""

    def sample(self, prompts: List[List[int]], count: int, seed: int) -> Tuple[List[List[List[int]]], List[List[bool]], float]:
        """Each prompt's completions, whether each was cut at max_new_tokens, and their summed entropy."""
        raise NotImplementedError


def left_padded(prompts: List[List[int]], pad: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one batch padded on the left (every completion starts at the same column), and its attention mask."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long), 1
    return ids, mask


class TransformersEngine(Engine):
    """transformers' generate on the weights being trained, with a KV cache, the model in eval mode while it samples."""

    def __init__(self, fabric, module, tokenizer, max_new_tokens: int, temperature: float, top_p: float):
        self.fabric, self.tokenizer = fabric, tokenizer
        self.model = module.module.model if hasattr(module, "module") else module.model
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stops = stop_tokens(self.model, tokenizer)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], greedy: bool, processors=()):
        with self.fabric.autocast():
            return self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=self.max_new_tokens, do_sample=not greedy,
                temperature=None if greedy else self.temperature, top_p=None if greedy else self.top_p, top_k=None if greedy else 0,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.stops, synced_gpus=self.fabric.world_size > 1,
                logits_processor=list(processors) or None,
            )

    def completion(self, row: torch.Tensor) -> Tuple[List[int], bool]:
        """A generated row cut after its first stop token; whether it ran to max_new_tokens without one."""
        tokens = row.tolist()
        for i, token in enumerate(tokens):
            if token in self.stops:
                return tokens[: i + 1], False
        return tokens, True

    def sample(self, prompts: List[List[int]], count: int, seed: int) -> Tuple[List[List[List[int]]], List[List[bool]], float]:
        device = self.fabric.device
        entropy = Entropy(len(prompts) * count, self.temperature, self.stops, device)
        devices = [device] if device.type == "cuda" else []
        ids, mask = left_padded([p for p in prompts for _ in range(count)], self.tokenizer.pad_token_id)
        with torch.random.fork_rng(devices=devices):  # the training's generators go on as if nothing was sampled
            torch.manual_seed(seed)
            out = self.generate(ids.to(device), mask.to(device), greedy=False, processors=[entropy])
        pieces = [self.completion(row) for row in out[:, ids.shape[1]:].cpu()]
        groups = [pieces[k * count : (k + 1) * count] for k in range(len(prompts))]
        return [[c for c, _ in g] for g in groups], [[cut for _, cut in g] for g in groups], float(entropy.sums.sum())
