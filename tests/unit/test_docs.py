"""The docs say what the code does: every litft command in README.md, docs/ and tutorials/ parses, and every link resolves."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "tutorials").glob("*.md"))]
COMMAND = re.compile(r"(?:^|[\s;&|(])((?:python -m )?litft\s+[a-z_]+\b.*)")
# Stand-ins for the placeholders a page writes: a model, a shell variable's value.
PLACEHOLDERS = {"<model>": "litft-tiny", "<moe model>": "litft-tiny-moe"}


def commands():
    """(page:line, the command) for each litft command in a shell code block, continuation lines joined."""
    found = []
    for page in PAGES:
        fenced, shell, pending = False, False, None
        for number, line in enumerate(page.read_text().splitlines(), 1):
            text = line.strip()
            if text.startswith("```"):
                fenced, shell = not fenced, text[3:].strip() in ("bash", "sh", "shell", "console")
                continue
            if not (fenced and shell):
                continue
            if pending is not None:
                pending[1] += " " + text.removesuffix("\\")
            else:
                match = COMMAND.search(text)
                if match is None:
                    continue
                pending = [f"{page.relative_to(ROOT)}:{number}", match.group(1).removesuffix("\\")]
            if not text.endswith("\\"):
                found.append(tuple(pending))
                pending = None
    return found


def words_of(command: str):
    """The command's arguments after ``litft``: comments, redirections and backgrounding dropped, placeholders filled."""
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    command = re.split(r"\s+#\s", command)[0]
    words = []
    for word in shlex.split(command):
        if word in ("&", "&&", "|") or re.match(r"^\d?>", word):
            break
        if word.startswith("$"):  # a shell variable: the value a user's script gives
            if word in ("$FLAGS", "$COMMON", "$@"):
                continue
            word = "1"
        words.append(word)
    return words[2:] if words[0] == "python" else words[1:]


CASES = commands()


def test_the_pages_hold_commands():
    assert len(CASES) > 40 and any(where.startswith("README.md") for where, _ in CASES)


@pytest.mark.parametrize("where, command", CASES, ids=[where for where, _ in CASES])
def test_every_documented_command_parses(where, command):
    """Parsed as the CLI parses it, up to --print_config: a flag that no longer exists, a misspelt group or a value the
    parser refuses fails here, naming the page and line."""
    from litft.__main__ import main

    words = words_of(command)
    checked = [*words, "--print_config"] if words[0] != "env" else [*words, "--help"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as stop:
        main(checked)
    assert stop.value.code in (0, None), f"{where}: litft {' '.join(words)}\n{err.getvalue().strip()}"


@pytest.mark.parametrize("line", ["litft finetune_full --train.max_step 3", "litft finetune_lora --lora_rank 8", "litft estimate --devcies 2"])
def test_the_check_fails_on_a_misspelt_flag(line):
    """What the check would say of a page holding this line (a prefix of a flag is refused too, not run as the flag)."""
    from litft.__main__ import main

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as stop:
        main([*words_of(line), "--print_config"])
    assert stop.value.code == 2


def anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen, found = {}, set()
    for line in page.read_text().splitlines():
        match = re.match(r"#+\s+(.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)
