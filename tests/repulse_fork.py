"""The RePULSe research fork's README commands (`repulse_fork_commands.txt` beside this file, verbatim),
read into (heading, module, argv) for the unit and end-to-end replays."""

from __future__ import annotations

import shlex
from pathlib import Path

COMMANDS = Path(__file__).with_name("repulse_fork_commands.txt")


def fork_commands() -> list[tuple[str, str, list[str]]]:
    """(heading, module, argv after `--module MODULE`) of every command in the file."""
    out, heading = [], None
    for line in COMMANDS.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:]
        elif line and not line.startswith("#"):
            tokens = shlex.split(line)
            at = tokens.index("--module")
            out.append((heading, tokens[at + 1], tokens[at + 2:]))
    return out


COMMAND_LIST = fork_commands()
TRAIN = [(h, argv) for h, module, argv in COMMAND_LIST if module == "openrlhf.cli.train_ppo"]
TOY = [(h, argv) for h, argv in TRAIN if h.startswith("Toy")]
REALISTIC = [(h, argv) for h, argv in TRAIN if not h.startswith("Toy")]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def set_flag(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value
GCG = [argv for _, module, argv in COMMAND_LIST if module.startswith("openrlhf.cli.evaluate_gcg")]
