"""``litft <job> ...``: each subcommand is a job function; its signature is the CLI and the YAML schema."""

import sys


def parser_jobs():
    from litft.convert import convert
    from litft.estimate import estimate
    from litft.jobs import finetune_full, finetune_lora, pretrain

    return {"pretrain": pretrain, "finetune_lora": finetune_lora, "finetune_full": finetune_full, "convert": convert, "estimate": estimate}


def configure_jsonargparse() -> None:
    from jsonargparse import set_parsing_settings

    # Field docstrings become --help text; `litft finetune_lora <model>` works without --model.
    set_parsing_settings(docstring_parse_attribute_docstrings=True, parse_optionals_as_positionals=True)


def one_line_parser():
    """jsonargparse's parser, reporting a bad flag in one line instead of the whole usage text."""
    import re

    from jsonargparse import ArgumentParser

    class OneLineErrors(ArgumentParser):
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

    return OneLineErrors


def main(argv=None) -> None:
    from jsonargparse import CLI

    from litft.errors import LitftError

    configure_jsonargparse()
    import litft.data  # noqa: F401  (registers the --data choices)

    try:
        CLI(parser_jobs(), args=argv, as_positional=True, parser_class=one_line_parser())
    except LitftError as err:
        print(f"litft: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
