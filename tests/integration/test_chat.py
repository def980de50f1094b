"""litft chat and generate on a LoRA run of litft-tiny: the same greedy answers as transformers, from every form of the model; and merge_lora."""

import io

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from litft.__main__ import main
from litft.cli.chat import one_line
from litft.config import EvalArgs, TrainArgs
from litft.data import TinyTasks
from litft.data.sft import alpaca_prompt
from litft.cli.jobs import finetune_lora

PROMPTS = ["Reverse the letters: a b c", "Sort the letters: d a c", "Add the numbers: 3 + 4"]
GREEDY = ["--prompt_style", "alpaca", "--temperature", "0", "--max_new_tokens", "8"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("chat") / "run"
    train = TrainArgs(global_batch_size=16, micro_batch_size=16, max_steps=12, learning_rate=3e-3, warmup_steps=2)
    finetune_lora(data=TinyTasks(num_train=192, num_val=8), out_dir=out, train=train, eval=EvalArgs(interval=0), lora_r=8, lora_dropout=0.0, export="both")
    return out


@pytest.fixture(scope="module")
def expected(lora_run):
    """Greedy answers of the merged model by transformers itself, to the prompts as Alpaca-style training renders them."""
    model = AutoModelForCausalLM.from_pretrained(lora_run / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(lora_run / "final")
    answers = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(alpaca_prompt(prompt, ""))["input_ids"]])
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


class Terminal(io.StringIO):
    """Typed lines, on what claims to be a terminal."""

    def isatty(self):
        return True


def chat_lines(monkeypatch, capsys, model, lines, *flags, tty=False):
    monkeypatch.setattr("sys.stdin", (Terminal if tty else io.StringIO)("".join(line + "\n" for line in lines)))
    main(["chat", str(model), *GREEDY, *flags])
    return capsys.readouterr().out


@pytest.mark.parametrize("form", ["final", "final-adapter", "checkpoint", "run"])
def test_piped_prompts_get_one_answer_line_each(monkeypatch, capsys, lora_run, expected, form):
    """From the merged model, the peft adapter on its base, the LoRA checkpoint (adapter on base) and the run folder."""
    model = {"final": lora_run / "final", "final-adapter": lora_run / "final-adapter", "run": lora_run,
             "checkpoint": lora_run / "checkpoints" / "step-00000012"}[form]
    printed = chat_lines(monkeypatch, capsys, model, PROMPTS)
    assert printed.splitlines() == [one_line(a) for a in expected]


def test_terminal_chat_streams_answers_and_quits(monkeypatch, capsys, lora_run, expected):
    printed = chat_lines(monkeypatch, capsys, lora_run / "final", [PROMPTS[0], "/reset", "/exit"], tty=True)
    header, answer, reset, after_exit = printed.split(">> ")
    assert header.startswith(f"litft chat: {lora_run / 'final'} (Ctrl-D or /exit quits")
    assert answer.strip() == expected[0] and reset == "(a new conversation)\n" and after_exit == ""


def test_generate_answers_one_prompt(capsys, lora_run, expected):
    main(["generate", str(lora_run / "final"), "--prompt", PROMPTS[1], *GREEDY])
    assert capsys.readouterr().out.strip() == expected[1]


def test_chat_template_and_sampling_flags(monkeypatch, capsys, lora_run):
    """--prompt_style chat uses the tokenizer's template with a system prompt; sampling with a seed repeats itself."""
    sampled = ["--prompt_style", "chat", "--system", "Answer briefly.", "--temperature", "1.0", "--top_p", "0.9", "--max_new_tokens", "6"]
    runs = []
    for _ in range(2):
        monkeypatch.setattr("sys.stdin", io.StringIO("a b c\n"))
        main(["chat", str(lora_run / "final"), *sampled, "--seed", "7"])
        runs.append(capsys.readouterr().out)
    assert len(runs[0].splitlines()) == 1 and runs[0] == runs[1]


def test_bad_generation_flags_are_one_line(capsys, lora_run):
    for flags, message in (
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or more"),
        (["--prompt_style", "alpaca", "--system", "x"], "--system needs --prompt_style chat"),
    ):
        with pytest.raises(SystemExit):
            main(["generate", str(lora_run / "final"), "--prompt", "hi", *flags])
        assert capsys.readouterr().err.startswith(f"litft: error: {message}")


def test_merge_lora_is_convert_with_the_adapter_folded_in(capsys, lora_run, tmp_path):
    main(["merge_lora", str(lora_run), "--out_dir", str(tmp_path / "merged")])
    merged, final = load_file(tmp_path / "merged" / "model.safetensors"), load_file(lora_run / "final" / "model.safetensors")
    assert merged.keys() == final.keys() and all(torch.equal(merged[k], final[k]) for k in final)
    with pytest.raises(SystemExit):
        main(["merge_lora", str(lora_run / "final-adapter")])
    assert "is a peft adapter folder; pass the run's folder or checkpoint" in capsys.readouterr().err
