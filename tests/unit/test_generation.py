"""The one generation service (litft.model.generation): what it decodes is the model's own argmax or the sampler's draw, in eval
mode, whatever the model's generation config says; a sampled token's log-prob is what a full forward of the model gives at
the temperature; a completion depends on its seed alone."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from litft.model.generation import Generation
from litft.parallel.mesh import DataPlace


@pytest.fixture(scope="module")
def service(tiny_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.config.attention_dropout = 0.5  # trained with dropout: sampling must not see it
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    # What a hub model's generation config may carry: each would change the answers if it reached generate.
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.num_beams = 2
    model.generation_config.suppress_tokens = list(range(0, 300, 2))
    model.train()
    fabric = SimpleNamespace(device=torch.device("cpu"), world_size=1, autocast=contextlib.nullcontext)
    return Generation(fabric, SimpleNamespace(model=model), tokenizer, DataPlace()), model


def prompts(tokenizer):
    texts = ["Reverse the letters: a b c", "Count to three", "x"]
    return [tokenizer(t)["input_ids"] for t in texts]


def test_greedy_answers_are_the_models_argmax_in_eval_mode_whatever_its_generation_config(service, tokenizer):
    generation, model = service
    modes = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda module, args: modes.append(module.training))
    try:
        answers = generation.greedy(prompts(tokenizer), max_new_tokens=6, per_call=2)
    finally:
        handle.remove()
    assert modes and not any(modes) and model.training  # eval while generating, training mode back after
    assert model.generation_config.repetition_penalty == 3.0  # the model's own config is set aside, not changed
    model.eval()
    with torch.no_grad():
        for prompt, answer in zip(prompts(tokenizer), answers):
            ids = list(prompt)
            for _ in range(6):  # argmax of a full forward, no cache, no processor
                token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(token)
                if token in generation.stops:
                    break
            assert answer.tokens == ids[len(prompt):]
            assert answer.cut == (ids[-1] not in generation.stops)
    model.train()


def test_a_sampled_tokens_log_prob_is_the_models_at_the_temperature_and_depends_on_its_seed_alone(service, tokenizer):
    generation, model = service
    every = prompts(tokenizer)
    with generation.generating():
        together, entropy = generation.sample(every, 3, [7, 8, 9], 8, temperature=0.7, top_p=0.9)
        alone, _ = generation.sample(every[1:2], 3, [8], 8, temperature=0.7, top_p=0.9)
    assert entropy > 0
    assert [c.tokens for c in together[1]] == [c.tokens for c in alone[0]]
    assert len({tuple(c.tokens) for group in together for c in group}) > 3  # draws differ between completions
    model.eval()
    with torch.no_grad():
        for prompt, group in zip(every, together):
            for completion in group:
                ids = torch.tensor([prompt + completion.tokens])
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
                expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.tokens)[:, None]).squeeze(1)
                assert len(completion.logprobs) == len(completion.tokens)
                torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)
    model.train()
