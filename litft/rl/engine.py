"""What samples completions for online RL: the interface every rollout engine gives, and the first engine, transformers'
``generate`` on the weights being trained (litft.model.generation).

An engine samples completions with the log-prob of each token at the sampling temperature (the trainer checks them
against its own: ``sampler_logprob_gap``), takes the trained weights after each optimizer step (``sync``), and can give
its device memory back between rollouts (``sleep`` / ``wake``). An engine that shares the trained module needs neither.
"""

from typing import List, Optional, Tuple

from litft.model.generation import Completion, Generation, Visual


class Engine:
    """What samples a cycle's rollouts."""

    name = "engine"
    shares_weights = True  # samples with the trained module itself: nothing to push, its log-probs are the trainer's
    version = None  # the optimizer step whose weights it holds, where it holds its own

    def rollouts(self):
        """A context held around one cycle's ``sample`` calls (the trained weights gathered once for all of them)."""
        raise NotImplementedError

    def sample(self, prompts: List[List[int]], count: int, seeds: List[int],
               visuals: Optional[List[Visual]] = None) -> Tuple[List[List[Completion]], float]:
        """``count`` completions of each prompt (tokens, whether cut, per-token log-probs at the sampling temperature) and
        their summed entropy; ``seeds``: one per prompt, from which alone its completions are drawn; ``visuals``: each
        prompt's text and images, where the model sees images."""
        raise NotImplementedError

    def sync(self, weights, version: int) -> None:
        """Take the trained weights after optimizer step ``version``."""

    def close(self) -> None:
        """Release the engine at the end of the run."""

    def sleep(self) -> None:
        """Give device memory back to training until ``wake``."""

    def wake(self) -> None:
        """Take the memory ``sleep`` gave back."""


class TransformersEngine(Engine):
    """transformers' ``generate`` on the weights being trained, through the run's one generation service."""

    name = "transformers"

    def __init__(self, generation: Generation, max_new_tokens: int, temperature: float, top_p: float):
        self.generation = generation
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    def rollouts(self):
        return self.generation.generating()

    def sample(self, prompts: List[List[int]], count: int, seeds: List[int],
               visuals: Optional[List[Visual]] = None) -> Tuple[List[List[Completion]], float]:
        return self.generation.sample(prompts, count, seeds, self.max_new_tokens, self.temperature, self.top_p, visuals)
