"""``litft evaluate`` and ``--eval.tasks`` on lm-evaluation-harness, against lm-eval's own ``--model hf``, on local tasks (a
multiple-choice task scored by log-likelihood and a generation task whose metric is the answer's length in characters, so
every generated character counts), over local JSON: nothing downloaded.

One LoRA run (its final/ merged, final-adapter/ and checkpoints) is evaluated as each form a run leaves: the merged folder
equals ``python -m lm_eval --model hf``, the adapter equals lm-eval's hf model with peft, the checkpoint (made in memory)
equals its merged export, 2 processes equal one, and the run's own --eval.tasks at step 0 equal its base model's. Bad input
is one line before anything is evaluated, with nothing written.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from litft.__main__ import main  # noqa: E402
from tests.conftest import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORDS = "apple river stone cloud garden silver paper window forest candle".split()
MC = """task: litft_reverse_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN = """task: litft_reverse_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
process_results: !function utils.answer_chars
metric_list:
  - metric: answer_chars
    aggregation: mean
    higher_is_better: true
"""
UTILS = '''def answer_chars(doc, results):
    return {"answer_chars": float(len(results[0]))}
'''
TASKS = "litft_reverse_mc,litft_reverse_gen"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The two tasks' YAML files, their metric function and 24 reverse-three-words documents."""
    import random

    folder = tmp_path_factory.mktemp("tasks")
    generator = random.Random(0)
    with open(folder / "docs.jsonl", "w") as f:
        for _ in range(24):
            w = generator.sample(WORDS, 3)
            f.write(json.dumps({"question": "Reverse: " + " ".join(w) + "\nAnswer:", "gold": 0, "answer": " ".join(reversed(w)),
                                "choices": [" " + " ".join(reversed(w)), " " + " ".join(w), " " + " ".join(sorted(w))]}) + "\n")
    (folder / "litft_reverse_mc.yaml").write_text(MC.format(docs=folder / "docs.jsonl"))
    (folder / "litft_reverse_gen.yaml").write_text(GEN.format(docs=folder / "docs.jsonl"))
    (folder / "utils.py").write_text(UTILS)
    return folder


@pytest.fixture(scope="module")
def run(tasks, tmp_path_factory):
    """A LoRA run that moved its adapter (lr 1e-2, 4 steps), both exports written, its --eval.tasks logged at steps 0 and 4."""
    out = tmp_path_factory.mktemp("run") / "lora"
    main(["finetune_lora", "--data.num_train", "32", "--data.num_val", "8", "--train.max_steps", "4", "--train.global_batch_size", "8",
          "--train.learning_rate", "1e-2", "--train.warmup_steps", "1", "--lora_r", "4", "--export", "both", "--eval.tasks", TASKS,
          "--eval.include_path", str(tasks), "--eval.interval", "0", "--precision", "32-true", "--accelerator", "cpu",
          "--logger_name", "csv", "--out_dir", str(out)])
    return out


def ours(model, tasks, out, *flags):
    main(["evaluate", str(model), "--tasks", TASKS, "--include_path", str(tasks), "--accelerator", "cpu", "--out_dir", str(out), *flags])
    return json.loads((out / "results.json").read_text())


def figures(results):
    return {task: {k: v for k, v in values.items() if "," in k} for task, values in results["results"].items()}


def test_each_form_of_a_run_scores_as_lm_eval_scores_it(run, tasks, tmp_path):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1")
    cli = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={run / 'final'}", "--tasks", TASKS,
                          "--include_path", str(tasks), "--device", "cpu", "--batch_size", "8", "--output_path", str(tmp_path / "cli")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert cli.returncode == 0, cli.stderr[-3000:]
    theirs = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())
    merged = figures(ours(run / "final", tasks, tmp_path / "final"))
    assert merged == figures(theirs)
    assert merged["litft_reverse_gen"]["answer_chars,none"] > 0
    # The checkpoint, made in memory a block at a time with its adapter merged: what its merged export scores.
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    scored = ours(checkpoint, tasks, tmp_path / "checkpoint")
    assert figures(scored) == merged and scored["litft"]["step"] == 4 and scored["litft"]["kind"] == "checkpoint"
    # The adapter on its base (not merged), as lm-eval's hf model with peft loads it.
    from lm_eval import simple_evaluate

    from litft.run.tasks import task_manager

    base = json.loads((run / "final-adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    from litft.model.loading import resolve_model

    lm_eval_adapter = simple_evaluate(model="hf", model_args=f"pretrained={resolve_model(base)},peft={run / 'final-adapter'}", tasks=TASKS.split(","),
                                      task_manager=task_manager(str(tasks)), batch_size=8, device="cpu", log_samples=False)
    assert figures(ours(run / "final-adapter", tasks, tmp_path / "adapter")) == figures(lm_eval_adapter)


def test_two_processes_split_the_documents_and_score_as_one(run, tasks, tmp_path):
    from tests.conftest import run_cli

    run_cli("evaluate", run / "final", "--tasks", TASKS, "--include_path", tasks, "--accelerator", "cpu", "--devices", "2",
            "--out_dir", tmp_path / "two", env={"HF_DATASETS_OFFLINE": "1"})
    one = ours(run / "final", tasks, tmp_path / "one")
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    for task, values in figures(one).items():
        assert figures(two)[task] == pytest.approx(values, rel=1e-9, abs=1e-12)


def test_the_runs_own_tasks_are_logged_and_start_where_its_base_scores(run, tasks, tmp_path):
    logged = [r for r in read_metrics(run) if "lm_eval/litft_reverse_mc/acc" in r]
    assert [r["step"] for r in logged] == [0, 4]
    base = figures(ours("litft-tiny", tasks, tmp_path / "base"))  # the adapter starts at zero: step 0 is the base model
    assert logged[0]["lm_eval/litft_reverse_mc/acc"] == pytest.approx(base["litft_reverse_mc"]["acc,none"], abs=1e-12)
    assert logged[0]["lm_eval/litft_reverse_gen/answer_chars"] == pytest.approx(base["litft_reverse_gen"]["answer_chars,none"], abs=1e-12)


def test_bad_input_is_one_line_before_anything_is_evaluated(run, tasks, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    nothing = tmp_path / "empty"
    nothing.mkdir()
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "no-such-base")}))
    cases = {
        "unknown task": (["evaluate", str(run / "final"), "--tasks", "litft_reverse_mc,no_such_task"], "--tasks no_such_task is no lm-eval task"),
        "no model": (["evaluate", str(nothing), "--tasks", "litft_reverse_mc"], "holds no model"),
        "adapter without its base": (["evaluate", str(adapter), "--tasks", "litft_reverse_mc"], "which cannot be found here"),
    }
    for name, (argv, says) in cases.items():
        with pytest.raises(SystemExit):
            main([*argv, "--include_path", str(tasks), "--accelerator", "cpu", "--out_dir", str(out)])
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and "Traceback" not in err, (name, err)
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"], name
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(SystemExit):
        main(["evaluate", str(run / "final"), "--tasks", "litft_reverse_mc", "--accelerator", "cpu", "--out_dir", str(out)])
    assert "pip install 'litft[eval]'" in capsys.readouterr().err and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
