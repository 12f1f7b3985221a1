"""docs/options.md from the `dflash-agent` commands' own click help, so option text has one source.

    python scripts/options_doc.py > docs/options.md

tests/test_docs.py fails when docs/options.md differs from what this prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_agent.cli import main  # noqa: E402

HEADER = """# Command options

Generated from each command's `--help` by `python scripts/options_doc.py > docs/options.md`; do not edit by hand
(`tests/test_docs.py` fails when this page differs from the help).
"""


def command_help(group: click.Group, name: str) -> str:
    """One command's help as `dflash-agent NAME --help` prints it, at a fixed width so the page does not vary."""
    command = group.get_command(click.Context(group), name)
    with click.Context(command, info_name=f"dflash-agent {name}", terminal_width=100, max_content_width=100) as ctx:
        return command.get_help(ctx)


def options_markdown() -> str:
    """The whole page: the group's own options, then every command's help in a code block."""
    sections = [HEADER]
    with click.Context(main, info_name="dflash-agent", terminal_width=100, max_content_width=100) as ctx:
        sections.append(f"## dflash-agent\n\n```text\n{main.get_help(ctx)}\n```\n")
    for name in main.list_commands(click.Context(main)):
        sections.append(f"## dflash-agent {name}\n\n```text\n{command_help(main, name)}\n```\n")
    return "\n".join(sections)


if __name__ == "__main__":
    sys.stdout.write(options_markdown())
