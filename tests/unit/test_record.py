"""benchmarks/record.py's GPU plan, checked where CI runs: the plan parses, and a group cut short keeps what it measured."""

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from gpu_record import GROUPS, stream_rows, trainer_rows  # noqa: E402


def test_the_gpu_plan_parses_with_each_scripts_own_flags():
    out = subprocess.run([sys.executable, str(BENCH / "record.py"), "--accelerator", "cuda", "--dry"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(f"dry {name} " in out.stdout for name in GROUPS)


def test_a_group_past_its_limit_keeps_the_sides_that_finished_and_ends_their_processes():
    script = ("import json, subprocess, sys, time\n"
              "print(json.dumps({'run': '1b-full', 'side': 'litft', 'tokens_per_s': 5.0, 'mfu': 0.4}), flush=True)\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(json.dumps({'pid': child.pid}), flush=True)\n"
              "time.sleep(60)\n")
    rows, stopped = stream_rows([sys.executable, "-c", script], limit=3)
    assert stopped == "past its 3 s limit"
    assert trainer_rows(rows[:1], {}) == {"gpu_1b_full_tok_s": 5.0, "gpu_1b_full_mfu": 0.4}
    child = rows[1]["pid"]

    def ended() -> bool:
        try:
            return "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]  # killed, not yet reaped by its init
        except OSError:
            return True

    deadline = time.monotonic() + 10  # SIGKILL is sent to the group; a loaded machine takes a moment to end the child
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended()


def test_a_side_that_fails_is_named_with_what_it_died_of_and_the_rest_is_read():
    rows = [{"run": "8b-lora", "side": "litft", "tokens_per_s": 14000.0, "mfu": 0.5},
            {"run": "8b-lora", "side": "trainer", "error": "Trainer exited 1: torch.OutOfMemoryError: CUDA out of memory"}]
    script = f"import sys\nfor row in {rows!r}: print(__import__('json').dumps(row))\nsys.exit(0)\n"
    got, stopped = stream_rows([sys.executable, "-c", script], limit=30)
    assert stopped is None and got == rows
    assert trainer_rows(got, {}) == {"gpu_8b_lora_tok_s": 14000.0, "gpu_8b_lora_mfu": 0.5}
    _, stopped = stream_rows([sys.executable, "-c", "import sys; sys.stderr.write('torch.OutOfMemoryError: CUDA out of memory\\n'); sys.exit(1)"], 30)
    assert stopped == "exited 1: torch.OutOfMemoryError: CUDA out of memory"


def test_the_compile_ablation_runs_each_variant_eager_and_compiled_on_the_cpu():
    """The GPU record's diagnosis of compile, at a tiny width: litft's attention and fused head compile as one code for
    every block (no recompile per layer), and each line pairs with its eager twin; Liger's variants say why they skip."""
    import json

    args = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--seq", "32", "--steps", "2", "--variants", "segments+head,litft"]
    out = subprocess.run([sys.executable, str(BENCH / "compile_ablation.py"), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    eager, compiled, liger = rows
    assert (eager["compiled"], eager["compiled_frames"]) == (False, 0) and eager["tokens_per_s"] > 0
    assert compiled["compiled"] and compiled["compiled_frames"] == 1 and compiled["compiled_over_eager"] > 0
    assert liger == {"variant": "litft", "skipped": "Liger's kernels run on CUDA only"}


def test_the_longest_sequence_search_brackets_the_limit_within_2_percent_and_stops_in_time():
    """longest_sequence.py's search against a stand-in device that fits 300,000 tokens, each try taking time quadratic in
    its length: from a start below the limit it grows, then halves the gap to within 2%; a budget too short for the next
    try stops it with the longest length that fitted so far."""
    from longest_sequence import next_length, search

    now = [0.0]

    def try_length(length):
        now[0] += 100 * (length / 200_000) ** 2
        return {"fits": length <= 300_000, "s": 100 * (length / 200_000) ** 2}

    found = search(try_length, 200_704, 1e9, clock=lambda: now[0])
    assert found["longest_fitting"] <= 300_000 < found["shortest_failing"] <= 1.02 * found["longest_fitting"] + 1024
    from_above = search(try_length, 400_384, 1e9, clock=lambda: now[0])
    assert from_above["longest_fitting"] <= 300_000 < from_above["shortest_failing"]
    now[0] = 0.0
    short = search(try_length, 200_704, 400, clock=lambda: now[0])  # 100 s, then 132 s: the third (175 s) would pass 400
    assert short == {"longest_fitting": 230_400, "shortest_failing": None, "tries": 2}
    now[0] = 50.0  # the model's build and the estimate took 50 s of the budget before the first try
    assert search(try_length, 200_704, 400, clock=lambda: now[0], began=0.0)["tries"] == 2  # 50 + 101 + 133, then 175 would pass
    assert next_length(1024, 2200, 1024) is None and next_length(None, 1024, 1024) is None  # nothing new left to try


def test_the_dropout_cost_side_switches_every_adapters_dropout_at_each_optimizer_step():
    """The switch under vs_hf_trainer's ``litft-dropout-alternating`` side (``alternate_dropout``): dropout on the even steps
    here, 0 on the odd ones, every adapter alike; undone, adapters keep their dropout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import vs_hf_trainer
    from litft.config import LoraArgs
    from litft.model.lora import DroppedInputLinear, apply_lora

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    undo = vs_hf_trainer.alternate_dropout(on_odd_steps=False)
    try:
        model = apply_lora(LlamaForCausalLM(config), LoraArgs(r=2, dropout=0.1))
        adapters = [m for m in model.modules() if isinstance(m, DroppedInputLinear)]
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        seen = []
        for _ in range(4):
            seen.append({m.dropout_p for m in adapters})
            optimizer.step()
    finally:
        undo()
    assert len(adapters) == 14 and seen == [{0.0}, {0.1}, {0.0}, {0.1}]
    again = apply_lora(LlamaForCausalLM(config), LoraArgs(r=2, dropout=0.1))
    torch.optim.SGD([p for p in again.parameters() if p.requires_grad], lr=0.1).step()
    assert {m.dropout_p for m in again.modules() if isinstance(m, DroppedInputLinear)} == {0.1}
