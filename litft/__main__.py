"""``litft <job> ...``: each subcommand is a job function; its signature is the CLI and the YAML schema."""

import sys


def parser_jobs():
    from litft.jobs import finetune_full, finetune_lora, pretrain

    return {"pretrain": pretrain, "finetune_lora": finetune_lora, "finetune_full": finetune_full}


def configure_jsonargparse() -> None:
    from jsonargparse import set_parsing_settings

    # Field docstrings become --help text; `litft finetune_lora <model>` works without --model.
    set_parsing_settings(docstring_parse_attribute_docstrings=True, parse_optionals_as_positionals=True)


def main(argv=None) -> None:
    from jsonargparse import CLI

    from litft.errors import LitftError

    configure_jsonargparse()
    import litft.data  # noqa: F401  (registers the --data choices)

    try:
        CLI(parser_jobs(), args=argv, as_positional=True)
    except LitftError as err:
        print(f"litft: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
