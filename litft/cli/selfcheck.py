"""Two real training steps of a tiny model per (job, strategy, precision), and what each must leave behind.

One runner for three users: ``litft env --check`` (each strategy this machine can
run), the CI precision matrix (every job x strategy x precision, on the CPU with
stand-ins for the CUDA kernel) and ``benchmarks/gpu_suite.py`` (the same matrix on
a GPU, resume included). The processes are started once and run every case in
turn, each case a whole litft job through its Python entry point: starting Python,
torch and transformers once per process instead of once per case is what keeps
the matrix to minutes.

What a case checks, beside finishing: the dtype attention computes in (bf16 under
both bf16 precisions) and receives (bf16 under bf16-true: nothing upcast on the
way), the dtype of the trained tensors the checkpoint stores (fp32 masters
except bf16-true, where they are bf16, and DeepSpeed, which keeps fp32 masters of
its bf16 module under both bf16 precisions), and that of a LoRA run's frozen base
(bf16 under both bf16 precisions, where the strategy can hold two dtypes).
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

from litft.launch.launchers import free_port

JOB_NAMES = ("pretrain", "finetune_full", "finetune_lora", "finetune_qlora")
STRATEGY_NAMES = ("single", "fsdp", "zero2", "zero3")  # ddp also runs: Case(job, "ddp", precision)
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


@dataclass(frozen=True)
class Case:
    """One run of the matrix: a job (QLoRA counted as its own), a strategy and a precision."""

    job: str
    strategy: str
    precision: str
    steps: int = 2
    resume: bool = False  # also stop after half the steps, resume, and compare with the uninterrupted run
    context_parallel: int = 1  # ranks that split each sequence (the whole world of a distributed case, at most)
    tensor_parallel: int = 1  # ranks that split each block (FSDP only)
    objective: str = "sft"  # a preference objective (dpo, ipo, simpo, orpo) trains on TinyPreferences, grpo on TinyPrompts
    expert_parallel: int = 1  # ranks that deal the experts out (FSDP only; trains litft-tiny-moe)
    moe: bool = False  # trains litft-tiny-moe (as expert parallel always does)

    @property
    def name(self) -> str:
        split = f" cp{self.context_parallel}" if self.context_parallel > 1 else ""
        split += f" tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        split += f" ep{self.expert_parallel}" if self.expert_parallel > 1 else (" moe" if self.moe else "")
        split += f" {self.objective}" if self.objective != "sft" else ""
        return f"{self.job} {self.strategy}{split} {self.precision}"

    @property
    def distributed(self) -> bool:
        return self.strategy != "single"

    def expected(self) -> Dict[str, str]:
        """The dtypes this case must show: attention's compute and input, and the checkpoint's trained tensors."""
        from litft.config import Layout
        from litft.parallel.strategies import strategy_class

        low = self.precision.startswith("bf16")
        flags = self.flags(Path("unused"), "cpu", 2)
        strategy = strategy_class(Layout(flags.get("strategy", "auto"), flags["devices"], 1, deepspeed=flags.get("deepspeed") or Layout().deepspeed))
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        return {
            "attention": "bfloat16" if low else "float32",
            "attention input": "bfloat16" if self.precision == "bf16-true" else "any",
            "saved": name(strategy.saved_dtype(self.precision)),
            "frozen": name(strategy.frozen_dtype(self.precision)) if self.job_function == "finetune_lora" else "none",
        }

    def flags(self, out_dir: Path, accelerator: str, world: int) -> dict:
        """The job function's keyword arguments (the flags a user would type)."""
        from litft.config import DeepSpeedArgs, EvalArgs, TrainArgs
        from litft.data.tiny import TinyTasks

        devices = world if self.distributed else 1
        flags = dict(
            out_dir=out_dir, precision=self.precision, devices=devices, context_parallel=self.context_parallel, tensor_parallel=self.tensor_parallel,
            expert_parallel=self.expert_parallel,
            accelerator=accelerator,
            overwrite=not self.resume,
            attn_implementation="litft_segments", logger_name="csv", seed=7,
            data=TinyTasks(num_train=64, num_val=8, mask_prompt=self.job != "pretrain", packing=self.job == "pretrain"),
            train=TrainArgs(global_batch_size=2 * devices, micro_batch_size=1, max_steps=self.steps, warmup_steps=0, save_interval=None),
            eval=EvalArgs(interval=10**6, initial_validation=False, final_validation=False),
        )
        if self.strategy == "ddp":
            flags["strategy"] = "ddp"
        elif self.strategy == "fsdp":
            flags["strategy"] = "fsdp"
        elif deepspeed_stage(self.strategy) is not None:
            flags.update(strategy="deepspeed", deepspeed=DeepSpeedArgs(stage=deepspeed_stage(self.strategy)))
        if self.job == "finetune_qlora":
            flags["quantize"] = "bnb.nf4"
        if self.expert_parallel > 1 or self.moe:
            from litft.model.tiny import TINY_MOE_NAME

            flags["model"] = TINY_MOE_NAME
        if self.objective == "grpo":  # a group of 4 short completions of each prompt, with a reward that splits them
            from litft.objectives.args import ObjectiveArgs
            from litft.data.prompts import TinyPrompts

            flags.update(objective=ObjectiveArgs(name="grpo", group_size=4, max_new_tokens=6, rewards="format", format_pattern=".*[aeiou].*"),
                         data=TinyPrompts(num_train=64, num_val=8))
        elif self.objective != "sft":
            from litft.objectives.args import ObjectiveArgs
            from litft.data.preference import TinyPreferences

            flags.update(objective=ObjectiveArgs(name=self.objective), data=TinyPreferences(num_train=64, num_val=8))
        return flags

    @property
    def job_function(self) -> str:
        return "finetune_lora" if self.job == "finetune_qlora" else self.job


def deepspeed_stage(strategy: str) -> Optional[int]:
    return int(strategy[4:]) if strategy.startswith("zero") else None


def matrix(jobs: Iterable[str] = JOB_NAMES, strategies: Iterable[str] = STRATEGY_NAMES, precisions: Iterable[str] = PRECISIONS, **case) -> List[Case]:
    return [Case(j, s, p, **case) for j in jobs for s in strategies for p in precisions]


def saved_dtypes(checkpoint: Path) -> set:
    """The dtypes of the trained tensors a litft checkpoint stores (its DCP metadata; nothing is loaded).

    Only the tensors its meta lists as trained: a 4-bit base's quantization buffers are stored too, in their own dtypes.
    """
    from torch.distributed.checkpoint import FileSystemReader

    trained = {f"model.{name}" for name in json.loads((checkpoint / "meta.json").read_text())["trained_shapes"]}
    metadata = FileSystemReader(str(checkpoint / "model")).read_metadata()
    return {str(meta.properties.dtype).removeprefix("torch.") for key, meta in metadata.state_dict_metadata.items() if key in trained}


def run_case(case: Case, out_dir: Path, accelerator: str, world: int, rendezvous: Callable[[], None] = lambda: None) -> dict:
    """Run one case in this process (every rank of it runs the same), and check what it left.

    ``rendezvous`` is called before each run of the job: a process group is never formed twice on one port.
    """
    from litft.model import attention
    from litft.errors import LitftError
    from litft.cli.jobs import JOBS

    started = time.perf_counter()
    result = {"case": case.name, "passed": False, "problems": []}
    attention.RECORD.clear()
    job = JOBS[case.job_function]
    flags = case.flags(out_dir, accelerator, world)
    try:
        if case.resume:
            # Uninterrupted, then the same run stopped half-way and resumed from its checkpoint: the same last loss.
            rendezvous()
            whole = job(**dict(flags, out_dir=out_dir / "whole", overwrite=True))
            half = dict(flags, out_dir=out_dir / "resumed", overwrite=True)
            half["train"] = type(flags["train"])(**{**asdict(flags["train"]), "stop_after_steps": case.steps // 2})
            rendezvous()
            job(**half)
            rendezvous()
            resumed = job(**dict(flags, out_dir=out_dir / "resumed", resume="auto"))
            result["losses"] = [h["loss"] for h in whole.history if "loss" in h]
            result["resumed losses"] = [h["loss"] for h in resumed.history if "loss" in h]
            difference = abs(result["losses"][-1] - result["resumed losses"][-1]) / abs(result["losses"][-1])
            result["resume difference"] = difference
            if difference > 1e-6:
                result["problems"].append(f"resumed loss differs from the uninterrupted run's by {difference:.2e} (relative)")
            done = resumed
        else:
            rendezvous()
            done = job(**flags)
            result["losses"] = [h["loss"] for h in done.history if "loss" in h]
    except LitftError as err:
        result["problems"].append(f"refused: {err}")
        result["refused"] = str(err)
        return result
    except Exception as err:  # noqa: BLE001 - a case that crashes is a failed case, not the end of the matrix
        traceback.print_exc()  # into the worker's log
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        result["problems"].append(f"{type(err).__name__}: {first[:300]}")
        return result
    finally:
        result["seconds"] = round(time.perf_counter() - started, 1)
    check_what_it_left(case, done, result)
    return result


def check_what_it_left(case: Case, done, result: dict) -> None:
    """The attention path it took, the dtypes its checkpoint and frozen base hold, and its losses, against the case's."""
    from litft.model import attention

    expected = case.expected()
    computed, received = attention.RECORD.computed(), attention.RECORD.received()
    result["attention"] = sorted({f"{path} {into} (got {got})" for path, got, into in attention.RECORD.seen})
    if computed != {expected["attention"]}:
        result["problems"].append(f"attention computed in {sorted(computed)}, expected {expected['attention']}")
    if expected["attention input"] != "any" and received != {expected["attention input"]}:
        result["problems"].append(f"attention received {sorted(received)}, expected {expected['attention input']}")
    checkpoints = sorted((done.out_dir / "checkpoints").glob("step-*"))
    saved = saved_dtypes(checkpoints[-1]) if checkpoints else set()
    result["saved"] = sorted(saved)
    if saved != {expected["saved"]}:
        result["problems"].append(f"the checkpoint stores trained tensors in {sorted(saved)}, expected {expected['saved']}")
    frozen = {str(p.dtype).removeprefix("torch.") for p in done.model.parameters() if not p.requires_grad and p.is_floating_point()}
    result["frozen"] = sorted(frozen)
    if frozen != ({expected["frozen"]} if expected["frozen"] != "none" else set()):
        result["problems"].append(f"the frozen base is in {sorted(frozen)}, expected {expected['frozen']}")
    if not all(map(_finite, result["losses"])) or not result["losses"]:
        result["problems"].append(f"losses {result['losses']}")
    result["passed"] = not result["problems"]


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def case_port(root: Path, index: int, rank: str, timeout: float = 600) -> int:
    """The ``index``-th rendezvous port: rank 0 picks a free one when that run starts and leaves it in a file the others read."""
    path = root / f"port-{index:02d}"
    if rank == "0":
        scratch = path.with_suffix(".tmp")
        scratch.write_text(str(free_port()))
        scratch.rename(path)
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 never started case {index}")
        time.sleep(0.05)
    return int(path.read_text())


def run_matrix(cases: List[Case], root: Path, accelerator: str = "cpu", world: int = 2, env: Optional[dict] = None,
               timeout: float = 1800, say=None) -> List[dict]:
    """Every case, one-device ones in one process, the others in ``world`` processes started once; a result per case, in order."""
    root.mkdir(parents=True, exist_ok=True)
    results: Dict[str, dict] = {}
    for label, group, size in (("one", [c for c in cases if not c.distributed], 1), ("many", [c for c in cases if c.distributed], world)):
        if not group:
            continue
        # Named by group, not size: with one GPU both groups run in one process and must not share a results file.
        plan = root / f"plan-{label}.json"
        for stale in root.glob("port-*"):
            stale.unlink()
        plan.write_text(json.dumps({"cases": [asdict(c) for c in group], "accelerator": accelerator, "world": world, "root": str(root)}))
        records = root / f"results-{label}.jsonl"
        records.unlink(missing_ok=True)
        base = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
            base.pop(key, None)
        procs = []
        for rank in range(size):
            rank_env = dict(base)
            if size > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1")
            log = open(root / f"worker-{label}-{rank}.log", "w")
            procs.append((subprocess.Popen([sys.executable, "-m", "litft.cli.selfcheck", str(plan), str(records), str(rank)],
                                           env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        seen = 0
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
            seen = _report(records, results, seen, say)
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
        _report(records, results, seen, say)
        for case in group:
            if case.name not in results:
                tail = (root / f"worker-{label}-0.log").read_text()[-1500:]
                results[case.name] = {"case": case.name, "passed": False, "problems": [f"no result (the workers ended or timed out): ...{tail}"]}
    return [results[c.name] for c in cases]


def _report(records: Path, results: dict, seen: int, say) -> int:
    if not records.is_file():
        return seen
    lines = records.read_text().splitlines()
    for line in lines[seen:]:
        if line.strip():
            record = json.loads(line)
            results[record["case"]] = record
            if say is not None:
                say(record)
    return len(lines)


def summary_line(record: dict) -> str:
    """One line per case: pass/fail, its name, its time and, for a failure, the first problem."""
    verdict = "pass" if record["passed"] else "FAIL"
    detail = f"attention {', '.join(record.get('attention', [])) or '-'}; saved {'/'.join(record.get('saved', [])) or '-'}"
    if not record["passed"]:
        detail = record["problems"][0]
    return f"{verdict}  {record['case']:<36} {record.get('seconds', 0):>5.1f} s  {detail}"


def worker(plan_path: str, records: str, rank: str) -> None:
    """One process of the matrix: every case of the plan in turn, each on its own rendezvous port; rank 0 writes the results."""
    plan = json.loads(Path(plan_path).read_text())
    root = Path(plan["root"])
    runs = itertools.count()

    def rendezvous() -> None:
        os.environ["MASTER_PORT"] = str(case_port(root, next(runs), rank))

    passed = []
    for index, fields in enumerate(plan["cases"]):
        case = Case(**fields)
        out_dir = root / f"{index:02d}-{case.name.replace(' ', '-')}"
        distributed = plan["world"] > 1 and case.distributed
        result = run_case(case, out_dir, plan["accelerator"], plan["world"], rendezvous if distributed else lambda: None)
        if rank == "0":
            with open(records, "a") as f:
                f.write(json.dumps(result) + "\n")
            if result["passed"]:
                passed.append(out_dir)
    # A passed case's folder goes only now: another rank may still be reading its checkpoint when rank 0 moves on.
    if rank == "0" and plan["world"] == 1:
        for out_dir in passed:
            shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    worker(*sys.argv[1:4])
