"""A job's ``--help``: the flags a first run needs first, the data choices with their options, and where the rest is.

jsonargparse's own help lists every flag of every group in signature order (about 370
lines for ``finetune_lora``), and the options of a ``--data`` choice only under
``--data.help NAME``. ``--help all`` still prints it.
"""

import dataclasses
import inspect
import re
from typing import Callable, Dict, List

# What a first run sets, in the order a user thinks of them; the rest of the groups follow by name only.
FIRST_RUN = ("model", "data", "out_dir", "precision", "devices", "num_nodes", "strategy", "quantize", "lora_r", "lora_alpha",
             "lora_dropout", "objective", "train.global_batch_size", "train.micro_batch_size", "train.max_steps", "train.epochs",
             "train.learning_rate", "resume", "overwrite")
GROUPS = ("train", "eval", "fsdp", "deepspeed", "objective")


def flag_help(function: Callable) -> Dict[str, str]:
    """Each flag's one line, from the ``Args:`` section of the command's docstring and its groups' field docstrings."""
    lines = {}
    args = (inspect.getdoc(function) or "").partition("Args:")[2]
    for match in re.finditer(r"^\s+(\w+): (.*)$", args, flags=re.M):
        lines[match.group(1)] = match.group(2)
    for name, parameter in inspect.signature(function).parameters.items():
        group = parameter.default
        if dataclasses.is_dataclass(group):
            documented = field_docs(type(group))
            for field in dataclasses.fields(group):
                lines[f"{name}.{field.name}"] = documented.get(field.name, "")
    return lines


def field_docs(cls) -> Dict[str, str]:
    """A dataclass's field docstrings (the string literal under each field), as jsonargparse reads them."""
    source = inspect.getsource(cls)
    return {m.group(1): " ".join(m.group(2).split()) for m in re.finditer(r"^\s+(\w+):[^\n]*\n\s+\"\"\"(.*?)\"\"\"", source, flags=re.M | re.S)}


def short_help(job: str, function: Callable, data_choices: Dict[str, List[str]]) -> str:
    """The job's help as a first run needs it."""
    lines = flag_help(function)
    doc = (inspect.getdoc(function) or "").split("\n\n")[0]
    out = [f"usage: litft {job} [MODEL] [--flag value ...]", "", doc, "", "The flags a first run sets:"]
    for name in FIRST_RUN:
        if name in lines:
            flag = "MODEL, --model" if name == "model" else f"--{name}"
            out.append(f"  {flag:<28} {shorten(lines[name])}")
    out += ["", "--data choices (--data NAME, then --data.OPTION value):"]
    for name, options in sorted(data_choices.items()):
        out.append(f"  {name:<16} {', '.join(options)}")
    groups = [g for g in GROUPS if any(k.startswith(f"{g}.") for k in lines)]
    others = [k for k in inspect.signature(function).parameters if k not in FIRST_RUN and k not in GROUPS]
    out += ["", f"Also: --{', --'.join(others)}; the groups {', '.join(f'--{g}.*' for g in groups)}.",
            f"Every flag with its help: litft {job} --help all. A YAML of this run's flags: litft {job} ... --print_config"]
    return "\n".join(out)


def shorten(text: str, width: int = 92) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3].rsplit(" ", 1)[0] + "..."
