"""What samples completions for online RL: an interface, so that another engine (vLLM) can come later without touching
the loop, and its first implementation, transformers' ``generate`` on the weights being trained.

Each completion draws its tokens from noise of its own: a Gumbel perturbation of the
logits computed from (its seed, its token's position, each vocabulary entry) by integer
hashing, and the perturbed maximum taken (the Gumbel-max trick: a draw from the softmax
at the temperature, after top-p). A completion's tokens then depend on its seed alone,
not on which other prompts share its batch or on how many there are, as one generator
over the whole batch would make them; and integer hashing gives the same noise on
every device.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from litft.compiling import eager_blocks
from litft.evaluation import stop_tokens

MASK32 = 0xFFFFFFFF


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


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each element of an int64 tensor holding values below 2**32 (products wrap; their low 32 bits
    are exact), mixing every input bit into every output bit."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


class GumbelSampler:
    """A logits processor that turns greedy decoding into sampling at ``temperature`` and ``top_p``, each row with noise
    of its own: row r's token t is the argmax of its warped scores plus Gumbel noise hashed from (seeds[r], t, token)."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float, device):
        self.temperature = temperature
        keyed = torch.tensor([[seed & MASK32, (seed >> 32) & MASK32] for seed in seeds], dtype=torch.int64, device=device)
        self.rows = hash32(hash32(keyed[:, 0]) ^ hash32(keyed[:, 1] + 0x9E3779B9))
        self.step = 0
        self.columns: Optional[torch.Tensor] = None
        self.top_p = None
        if top_p < 1.0:
            from transformers import TopPLogitsWarper

            self.top_p = TopPLogitsWarper(top_p)

    def noise(self, vocabulary: int) -> torch.Tensor:
        """Gumbel noise of every row for this token, (rows, vocabulary), in float32."""
        if self.columns is None or len(self.columns) != vocabulary:
            self.columns = hash32(torch.arange(vocabulary, dtype=torch.int64, device=self.rows.device) + 0xC2B2AE35)
        token = hash32(self.rows ^ hash32(self.rows.new_tensor(self.step + 0x85EBCA6B)))
        bits = hash32(token[:, None] ^ self.columns) >> 8  # 24 bits: exact in float32
        uniform = (bits.float() + 0.5) / 2**24
        return -torch.log(-torch.log(uniform))

    def __call__(self, input_ids, scores):
        warped = scores.float() / self.temperature
        if self.top_p is not None:
            warped = self.top_p(input_ids, warped)
        self.step += 1
        return warped + self.noise(warped.shape[-1])


class Engine:
    """What samples completions: ``sample`` gives ``count`` completions (token ids, ended by a stop token unless cut) of each
    of some prompts, sampled together."""

    def sample(self, prompts: List[List[int]], count: int, seeds: List[int]) -> Tuple[List[List[List[int]]], List[List[bool]], float]:
        """Each prompt's completions, whether each was cut at max_new_tokens, and their summed entropy; ``seeds``: one per
        prompt, from which alone its completions are drawn."""
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
    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], processors=()):
        """Greedy decoding of the processed scores: the argmax, or a sample where a processor adds noise (GumbelSampler). No
        warper or penalty of the model's generation config applies: the completions come from the policy the loss sees."""
        with self.fabric.autocast(), eager_blocks():
            return self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=self.max_new_tokens, do_sample=False,
                repetition_penalty=1.0, pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.stops,
                synced_gpus=self.fabric.world_size > 1, logits_processor=list(processors) or None,
            )

    def completion(self, row: torch.Tensor) -> Tuple[List[int], bool]:
        """A generated row cut after its first stop token; whether it ran to max_new_tokens without one."""
        tokens = row.tolist()
        for i, token in enumerate(tokens):
            if token in self.stops:
                return tokens[: i + 1], False
        return tokens, True

    def sample(self, prompts: List[List[int]], count: int, seeds: List[int]) -> Tuple[List[List[List[int]]], List[List[bool]], float]:
        device = self.fabric.device
        entropy = Entropy(len(prompts) * count, self.temperature, self.stops, device)  # first: it reads the scores as the model gave them
        rows = [seed ^ ((j * 0x9E3779B97F4A7C15) & (2**64 - 1)) for seed in seeds for j in range(count)]  # a seed per completion
        sampler = GumbelSampler(rows, self.temperature, self.top_p, device)
        ids, mask = left_padded([p for p in prompts for _ in range(count)], self.tokenizer.pad_token_id)
        out = self.generate(ids.to(device), mask.to(device), processors=[entropy, sampler])
        pieces = [self.completion(row) for row in out[:, ids.shape[1]:].cpu()]
        groups = [pieces[k * count : (k + 1) * count] for k in range(len(prompts))]
        return [[c for c, _ in g] for g in groups], [[cut for _, cut in g] for g in groups], float(entropy.sums.sum())
