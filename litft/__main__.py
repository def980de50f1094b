"""``litft <command> ...``: each subcommand is a function; its signature is the CLI and the YAML schema.

The program quiets one library before importing the rest: bitsandbytes, imported
by peft, logs advice to install an optional kernel package (which fetches kernels
from the hub) on every process of every run, and that happens during the imports.
"""

import logging
import re
import sys

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from jsonargparse import CLI, ArgumentParser, set_parsing_settings  # noqa: E402

import litft.data  # noqa: E402,F401  (registers the --data choices)
from litft.chat import chat, generate  # noqa: E402
from litft.checkpoint.convert import convert, merge_lora  # noqa: E402
from litft.errors import LitftError  # noqa: E402
from litft.estimate import estimate  # noqa: E402
from litft.jobs import JOBS  # noqa: E402
from litft.launchers import without_local_rank_argument  # noqa: E402
from litft.ray_worker import die_with_parent, inside_worker  # noqa: E402


def parser_jobs() -> dict:
    return {**JOBS, "convert": convert, "merge_lora": merge_lora, "estimate": estimate, "chat": chat, "generate": generate}


def configure_jsonargparse() -> None:
    # Field docstrings become --help text; `litft finetune_lora <model>` works without --model.
    set_parsing_settings(docstring_parse_attribute_docstrings=True, parse_optionals_as_positionals=True)


class OneLineErrors(ArgumentParser):
    """jsonargparse's parser, reporting a bad flag in one line instead of the whole usage text."""

    def error(self, message, ex=None):
        if not self.exit_on_error:
            return super().error(message, ex)
        text = re.sub(r'Parser key "([^"]+)":', r"--\1:", str(message))
        text = "; ".join(line.strip() for line in text.splitlines() if line.strip()).replace(":;", ":")
        text = re.sub(r"Expected a typing\.Literal\[(.*)\]\. Got value:", r"expected one of \1, got", text)
        text = re.sub(r"Expected a <class '(\w+)'>\. Got value:", r"expected \1, got", text)
        prog = (getattr(ex, "subcommand_parser", None) or self).prog.replace(" [options]", "")
        print(f"litft: error: {text[:400]} (see {prog} --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> None:
    if inside_worker():
        die_with_parent()  # a Ray worker's training ends with its actor
    configure_jsonargparse()
    try:
        argv = without_local_rank_argument(sys.argv[1:] if argv is None else list(argv))
        CLI(parser_jobs(), args=argv, as_positional=True, parser_class=OneLineErrors)
    except LitftError as err:
        print(f"litft: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
