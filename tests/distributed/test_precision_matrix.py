"""Every job x strategy x precision trains two steps on the CPU through the CUDA attention branch, or is refused in one line.

The varlen flash kernel is replaced by a stand-in with torch 2.11's signature (no
enable_gqa, fp16/bf16 only: tests/varlen_standins.py), so the branch a GPU takes
runs here; each case checks the dtype attention computes in and receives, and the
dtype of the trained tensors its checkpoint stores (litft/cli/selfcheck.py).
"""

import time

import pytest

from litft.config import DeepSpeedArgs, FSDPArgs, Layout
from litft.errors import LitftError
from litft.parallel.strategies import checked_strategy_class
from litft.cli.selfcheck import Case, matrix, run_case, run_matrix, summary_line
from tests.conftest import ROOT

STANDIN = {"LITFT_VARLEN_KERNEL": "tests.varlen_standins:varlen_attn_2_11", "PYTHONPATH": str(ROOT)}


def test_every_job_strategy_and_precision(tmp_path):
    """4 jobs (QLoRA counted) x one device, FSDP, ZeRO-2, ZeRO-3 x 32-true, bf16-mixed, bf16-true, less the sharded 32-true
    cells: tests/distributed/test_sharding.py holds fp32 to one process exactly (full fine-tuning under each sharding, LoRA
    and QLoRA under FSDP and ZeRO-3, pretraining under FSDP and ZeRO-3), which is more than this test asks; LoRA and QLoRA
    under ZeRO-2 run here in both bf16 precisions."""
    cases = [case for case in matrix() if case.precision != "32-true" or case.strategy == "single"]
    assert len(cases) == 36
    results = run_matrix(cases, tmp_path, accelerator="cpu", world=2, env=STANDIN)
    failed = [summary_line(r) for r in results if not r["passed"]]
    assert not failed, "\n".join(failed)
    by_name = {r["case"]: r for r in results}
    # The bf16 runs went through the kernel's branch, the fp32 ones kept off it.
    assert by_name["finetune_lora fsdp bf16-true"]["attention"] == ["varlen bfloat16 (got bfloat16)"]
    assert by_name["pretrain single 32-true"]["attention"] == ["sdpa float32 (got float32)"]
    assert by_name["finetune_qlora zero3 bf16-mixed"]["saved"] == ["float32"]


def test_context_tensor_expert_parallel_and_preference_under_each_sharding_and_bf16_precision(tmp_path):
    """A context group of both ranks, through the kernel's branch: each job with each sharding, each sharding with each bf16
    precision; a tensor-parallel group of both ranks under FSDP, full and LoRA, in each bf16 precision (the exact matches
    with one process are tests/distributed/test_sharding.py's, in fp32); an expert group of both ranks (litft-tiny-moe),
    full, LoRA and QLoRA, in each bf16 precision (exact in fp32: tests/distributed/test_expert_parallel.py), and LoRA on its
    experts under ZeRO-3 (the adapters read from partitioned modules whose forward never runs); preference
    objectives and GRPO under each."""
    cases = [
        Case(job, strategy, precision, context_parallel=2)
        for job, strategy, precision in (
            ("finetune_full", "fsdp", "bf16-true"), ("finetune_full", "zero3", "bf16-mixed"),
            ("finetune_qlora", "fsdp", "bf16-mixed"), ("finetune_qlora", "zero3", "bf16-true"),
        )
    ] + [Case("finetune_full", "fsdp", "bf16-mixed", tensor_parallel=2), Case("finetune_lora", "fsdp", "bf16-true", tensor_parallel=2)]
    cases += [Case("finetune_full", "fsdp", "bf16-true", expert_parallel=2), Case("finetune_lora", "fsdp", "bf16-mixed", expert_parallel=2),
              Case("finetune_qlora", "fsdp", "bf16-true", expert_parallel=2), Case("finetune_lora", "zero3", "bf16-mixed", moe=True)]
    # Preference objectives in the bf16 precisions, on the processes already started (their exact matches are in fp32:
    # tests/distributed/test_preference.py): the adapter-off reference, the precomputed one, and a reference-free objective.
    cases += [
        Case("finetune_lora", "fsdp", "bf16-true", objective="dpo"), Case("finetune_qlora", "zero3", "bf16-mixed", objective="dpo"),
        Case("finetune_full", "zero2", "bf16-mixed", objective="dpo"), Case("finetune_full", "fsdp", "bf16-true", objective="orpo"),
    ]
    # GRPO: generation under ZeRO-3's and FSDP's gathering in each bf16 precision, QLoRA's 4-bit base included (exact in fp32:
    # tests/distributed/test_rl.py).
    cases += [Case("finetune_lora", "zero3", "bf16-true", objective="grpo"), Case("finetune_qlora", "fsdp", "bf16-mixed", objective="grpo"),
              Case("finetune_full", "fsdp", "bf16-true", objective="grpo")]
    results = run_matrix(cases, tmp_path, accelerator="cpu", world=2, env=STANDIN)
    failed = [summary_line(r) for r in results if not r["passed"]]
    assert not failed, "\n".join(failed)
    assert {tuple(r["attention"]) for r in results} == {("varlen bfloat16 (got bfloat16)",)}


def test_an_unsupported_combination_is_one_line_before_any_process(tmp_path):
    """fp16 autocast on the CPU, and FSDP with fp16 anywhere (FSDP2 has no loss scaling), are refused before a process starts."""
    started = time.perf_counter()
    result = run_case(Case("finetune_qlora", "zero3", "16-mixed"), tmp_path / "run", "cpu", world=2)
    assert result["refused"].startswith("--precision 16-mixed needs a GPU") and "\n" not in result["refused"]
    assert not (tmp_path / "run").exists() and time.perf_counter() - started < 30  # nothing started, nothing written
    layout = Layout("fsdp", 2, 1, FSDPArgs(), DeepSpeedArgs())
    with pytest.raises(LitftError, match="^--strategy fsdp trains in 32-true, bf16-mixed or bf16-true; fp16 needs loss scaling"):
        checked_strategy_class(layout, "cuda", "16-mixed")
