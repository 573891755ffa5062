"""The CLI surface (commands, arguments, options) is pinned, so it changes only on purpose.

After an intended change, regenerate the snapshot with QBUILD_UPDATE_SNAPSHOT=1 and review its diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from qbuild.cli import app

SNAPSHOT = Path(__file__).with_name("cli_surface.txt")


def _surface(cmd, prefix: str = "qbuild") -> list[str]:
    lines = []
    params = []
    for p in cmd.params:
        if p.param_type_name == "option":
            params.append("/".join(sorted(p.opts)) + ("" if p.is_flag else "=VALUE"))
        else:
            params.append(f"<{p.name}{'...' if p.nargs == -1 else ''}>")
    lines.append(f"{prefix}: {' '.join(params)}".rstrip())
    if hasattr(cmd, "commands"):
        for name in sorted(cmd.commands):
            lines += _surface(cmd.commands[name], f"{prefix} {name}")
    return lines


def test_cli_surface_matches_the_snapshot():
    surface = "\n".join(_surface(typer.main.get_command(app))) + "\n"
    if os.environ.get("QBUILD_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(surface)
    assert surface == SNAPSHOT.read_text(), "the CLI changed; if on purpose, regenerate with QBUILD_UPDATE_SNAPSHOT=1"


def test_every_command_has_help():
    def walk(cmd, name: str):
        yield name, cmd
        if hasattr(cmd, "commands"):
            for sub, c in cmd.commands.items():
                yield from walk(c, f"{name} {sub}")

    missing = [name for name, cmd in walk(typer.main.get_command(app), "qbuild") if not (cmd.help or "").strip()]
    assert missing == []
