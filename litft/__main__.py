"""``litft <command> ...``: each subcommand is a function; its signature is the CLI and the YAML schema."""

import re
import sys

from jsonargparse import CLI, ArgumentParser, set_parsing_settings

import litft.data  # noqa: F401  (registers the --data choices)
from litft.checkpoint.convert import convert
from litft.errors import LitftError
from litft.estimate import estimate
from litft.jobs import JOBS


def parser_jobs() -> dict:
    return {**JOBS, "convert": convert, "estimate": estimate}


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
    configure_jsonargparse()
    try:
        CLI(parser_jobs(), args=argv, as_positional=True, parser_class=OneLineErrors)
    except LitftError as err:
        print(f"litft: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
