"""``litft <command> ...``: each subcommand is a function; its signature is the CLI and the YAML schema.

Two libraries' import-time chatter is quieted in the package's ``__init__``, so that
every entry point (this one, the matrix workers, a user's own script) is quiet.
"""

import dataclasses
import difflib
import gc
import inspect
import re
import sys
import typing
from typing import List, Optional

from jsonargparse import CLI, ArgumentParser, set_parsing_settings  # noqa: E402

import litft.data  # noqa: E402,F401  (registers the --data choices)
from litft.cli.chat import chat, generate  # noqa: E402
from litft.cli.help import short_help  # noqa: E402
from litft.checkpoint.convert import convert, merge_lora  # noqa: E402
from litft.cli.download import download  # noqa: E402
from litft.cli.envreport import env  # noqa: E402
from litft.cli.evaluate import evaluate  # noqa: E402
from litft.errors import LitftError  # noqa: E402
from litft.estimate import estimate  # noqa: E402
from litft.cli.jobs import DEFAULT_DATA_FLAGS, JOBS, PREFERENCE_DATA_FLAGS  # noqa: E402
from litft.launch.launchers import without_local_rank_argument  # noqa: E402
from litft.run.logs import quiet_libraries  # noqa: E402
from litft.launch.ray_worker import die_with_parent, inside_worker  # noqa: E402


def parser_jobs() -> dict:
    return {**JOBS, "convert": convert, "merge_lora": merge_lora, "estimate": estimate, "chat": chat, "generate": generate, "env": env,
            "download": download, "evaluate": evaluate}


def configure_jsonargparse() -> None:
    # Field docstrings become --help text. Only the model is given by position (model_by_position): with
    # jsonargparse's optionals-as-positionals, `--devcies 2` was read as two positional values for later flags.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)


def model_by_position(argv: List[str], commands: dict) -> List[str]:
    """``litft <job> MODEL ...`` as ``--model MODEL``: the one value a user gives by position, where the command has a default for it.

    Commands whose first argument is required (chat, convert, ...) take it by position already.
    A word beginning with ``-`` is never taken as the model. It goes last, so that it wins over a
    ``--config`` file's ``model:``, as a value given on the command line should.
    """
    if len(argv) < 2 or argv[0] not in commands or argv[1].startswith("-"):
        return argv
    first = next(iter(inspect.signature(commands[argv[0]]).parameters.values()))
    if first.default is inspect.Parameter.empty:
        return argv
    return [argv[0], *argv[2:], f"--{first.name}", argv[1]]


def default_data_named(argv: List[str]) -> List[str]:
    """``--data.X`` options without ``--data`` (or a ``--config`` that may name it) refer to the job's default data: name it first."""
    options = [i for i, word in enumerate(argv) if word.startswith("--data.")]
    named = any(word == "--data" or word.startswith(("--data=", "--config")) for word in argv)
    if not argv or argv[0] not in DEFAULT_DATA_FLAGS or not options or named:
        return argv
    named_objective = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--objective.name"]
    named_objective += [word.split("=", 1)[1] for word in argv if word.startswith("--objective.name=")]
    objective = named_objective[-1] if named_objective else "sft"
    default = {"sft": DEFAULT_DATA_FLAGS[argv[0]], "grpo": ["--data", "TinyPrompts"]}.get(objective, PREFERENCE_DATA_FLAGS)
    return [*argv[: options[0]], *default, *argv[options[0]:]]


def objective_named(argv: List[str]) -> List[str]:
    """``--objective dpo`` (or ``--objective=dpo``) as ``--objective.name dpo``: the objective's name is its group's one plain value."""
    out = []
    for i, word in enumerate(argv):
        name = word.split("=", 1)[1] if word.startswith("--objective=") else None
        if name is not None and re.fullmatch(r"[A-Za-z_]+", name):
            out += ["--objective.name", name]
        elif word == "--objective" and i + 1 < len(argv) and re.fullmatch(r"[A-Za-z_]+", argv[i + 1]):  # a name, not a file or a dict
            out.append("--objective.name")
        else:
            out.append(word)
    return out


def boolean_flags(function) -> set:
    """The ``--flag`` spellings of a command's yes/no options, its dataclass groups' (``--train.X``) included."""
    found = set()

    def walk(hints: dict, prefix: str) -> None:
        for name, hint in hints.items():
            kinds = typing.get_args(hint) or (hint,)
            if bool in kinds:
                found.add(f"--{prefix}{name}")
            for kind in kinds:
                if dataclasses.is_dataclass(kind):
                    walk(typing.get_type_hints(kind), f"{prefix}{name}.")

    walk({name: p.annotation for name, p in inspect.signature(function).parameters.items()}, "")
    return found


def bare_booleans(argv: List[str], commands: dict) -> List[str]:
    """``--check`` or ``--overwrite`` alone (nothing after it, or another flag next) as ``--check true``."""
    if not argv or argv[0] not in commands:
        return argv
    flags = boolean_flags(commands[argv[0]])
    out = []
    for i, word in enumerate(argv):
        out.append(word)
        following = argv[i + 1] if i + 1 < len(argv) else None
        if word in flags and (following is None or following.startswith("--")):
            out.append("true")
    return out


def nearest_flag(parser, unknown: str) -> Optional[str]:
    """The known flag closest in spelling to ``unknown`` (``--devcies`` -> ``--devices``), if any is close."""
    known = [o[2:] for action in parser._actions for o in action.option_strings if o.startswith("--")]
    # Compared without the dashes, which every flag shares (--foo is not near --fp8).
    found = difflib.get_close_matches(unknown.split("=")[0].lstrip("-"), known, n=1, cutoff=0.6)
    return "--" + found[0] if found else None


def data_classes() -> dict:
    """Every ``--data`` choice by name, and its options."""
    from litft.data.base import DataModule

    found, stack = {}, list(DataModule.__subclasses__())
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        if dataclasses.is_dataclass(cls):
            found[cls.__name__] = [f.name for f in dataclasses.fields(cls)]
    return found


def data_option_error(message: str) -> Optional[str]:
    """jsonargparse's union message for a --data.X the data class does not take, as what to change (None for other messages)."""
    match = re.search(r"Problem with given class_path '[\w.]*?(\w+)': Option '(\w+)' is not accepted", message)
    if match is None:
        return None
    chosen, option = match.groups()
    classes = data_classes()
    owners = sorted(name for name, options in classes.items() if option in options)
    if owners:
        return (f"--data.{option} is an option of --data {' / '.join(owners)}, not of {chosen} (this run's data); "
                f"add --data {owners[0]} before it")
    near = difflib.get_close_matches(option, classes.get(chosen, []), n=1, cutoff=0.6)
    hint = f"; did you mean --data.{near[0]}?" if near else f"; its options: {', '.join(classes.get(chosen, []))}"
    return f"--data {chosen} has no option {option}{hint}"


def data_choice_error(message: str) -> Optional[str]:
    """jsonargparse's union message for a ``--data NAME`` that names no data module, as the nearest choice (None otherwise)."""
    match = re.search(r"^--data: .*Given value: ([\w.]+)", message)
    if match is None or "Union subtypes" not in message:
        return None
    given, classes = match.group(1), sorted(data_classes())
    near = difflib.get_close_matches(given.rpartition(".")[2], classes, n=1, cutoff=0.6)
    return f"--data {given} is no data module; " + (f"did you mean --data {near[0]}?" if near else f"choose one of {', '.join(classes)}")


class OneLineErrors(ArgumentParser):
    """jsonargparse's parser, reporting a bad flag in one line instead of the whole usage text, and taking no prefix of a
    flag for the flag (``--train.max_step`` is refused with the suggestion, not run as ``--train.max_steps``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message, ex=None):
        if not self.exit_on_error:
            return super().error(message, ex)
        data = data_option_error(" ".join(str(message).split()))
        if data is not None:
            print(f"litft: error: {data}", file=sys.stderr)
            sys.exit(2)
        parser = getattr(ex, "subcommand_parser", None) or self
        unrecognized = re.search(r"unrecognized arguments: (.*)", str(message), re.IGNORECASE)
        if unrecognized:
            words = unrecognized.group(1).split()
            flag = next((w for w in words if w.startswith("-")), None)
            if flag is None:
                text = f"unexpected value {words[0]!r}: only the model is given by position, every other value after its --flag"
            else:
                near = nearest_flag(parser, flag)
                text = f"unknown flag {flag}" + (f"; did you mean {near}?" if near else "")
            print(f"litft: error: {text} (see {parser.prog.replace(' [options]', '')} --help)", file=sys.stderr)
            sys.exit(2)
        text = re.sub(r'Parser key "([^"]+)":', r"--\1:", str(message))
        text = "; ".join(line.strip() for line in text.splitlines() if line.strip()).replace(":;", ":")
        text = re.sub(r"Expected a typing\.Literal\[(.*)\]\. Got value:", r"expected one of \1, got", text)
        text = re.sub(r"Expected a <class '(\w+)'>\. Got value:", r"expected \1, got", text)
        text = data_choice_error(text) or text
        prog = (getattr(ex, "subcommand_parser", None) or self).prog.replace(" [options]", "")
        print(f"litft: error: {text[:400]} (see {prog} --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> None:
    if inside_worker():
        die_with_parent()  # a Ray worker's training ends with its actor
    configure_jsonargparse()
    quiet_libraries()  # every command: no loading bars or libraries' advice on the user's screen
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] in JOBS and argv[1] in ("--help", "-h"):
        print(short_help(argv[0], JOBS[argv[0]], data_classes()))
        sys.exit(0)
    if len(argv) == 3 and argv[0] in JOBS and argv[1:] == ["--help", "all"]:
        argv = argv[:2]
    try:
        argv = model_by_position(without_local_rank_argument(argv), parser_jobs())
        argv = bare_booleans(default_data_named(objective_named(argv)), parser_jobs())
        CLI(parser_jobs(), args=argv, as_positional=True, parser_class=OneLineErrors, prog="litft")
    except LitftError as err:
        # One write, line and newline together: every rank says it on a shared stderr, and print's two writes
        # (text, then newline) from two processes could land as "error...error...\n\n", one line for two.
        sys.stderr.write(f"litft: error: {err}\n")
        sys.stderr.flush()
        sys.exit(2)


def command() -> None:
    """The ``litft`` program: ``main``, then an exit that skips the garbage collector's last passes.

    At exit Python collects every tracked object (torch's, transformers' and the run's): about
    two seconds of every process, each rank of a run included. Frozen first, they are left to
    the operating system; atexit handlers (trackers' final uploads) and flushes still run.
    Only after a run that ended well: a failing process leaves as it always did.
    """
    main()
    gc.freeze()


if __name__ == "__main__":
    command()
