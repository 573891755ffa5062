"""The qbuild command line: parse flags, call the library, render. stdout carries data; stderr the rest.

One module per noun: plan (plan, explain), build (compile), report, remote (publish, pull), store (gc, store
verify), lock (lock check, lock update), recipe (recipe validate, recipe schema), tiny, run (run, bench), serve.
options holds the options several commands share, exits how a command ends (its line on stderr, its exit code).
This module wires them into one app; `main` runs it.

May import: every layer (the top of the layers: nothing imports it).
"""

import os
import signal
import sys


def _interrupted_outside_a_command(signum, frame) -> None:
    # Ctrl-C while the modules load or after the command returned: nothing is half-written there, and a
    # KeyboardInterrupt raised in an import or in the exit path would print a traceback instead of the one line.
    os.write(2, b"interrupted\n")
    os._exit(130)


# Only where this package is the program (`qbuild`, `python -m qbuild.cli`, whose sys.argv[0] is "-m" while Python
# imports this package on its way to qbuild/cli/__main__.py): a process that imports it as a library keeps its own
# Ctrl-C.
if os.path.basename((sys.argv or [""])[0]) in ("qbuild", "-m"):
    signal.signal(signal.SIGINT, _interrupted_outside_a_command)

import typer

import qbuild
from qbuild.cli import build, lock, plan, recipe, remote, report, run, serve, store, tiny
from qbuild.cli.exits import GuardedOutput, check_cwd, err, exit_code

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build, verify and publish compiled Qwen3.5 / Qwen3-Next artifacts from YAML recipes.")
app.add_typer(recipe.app, name="recipe")
app.add_typer(lock.app, name="lock")
app.add_typer(store.app, name="store")
# The commands, in the order --help lists them.
app.command()(plan.plan)
app.command()(report.report)
app.command()(build.compile)
app.command()(plan.explain)
app.command()(remote.publish)
app.command()(remote.pull)
app.command("gc")(store.gc_cmd)
app.command()(tiny.tiny)
app.command()(run.run)
app.command()(run.bench)
app.command()(serve.serve)


def _version(value: bool) -> None:
    if value:
        print(f"qbuild {qbuild.__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Takes --version before any command runs; the commands do the work."""


def main() -> None:
    stdout = sys.stdout
    sys.stdout = GuardedOutput(stdout)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        check_cwd()
        # Without standalone mode, click returns a command's typer.Exit code instead of raising it.
        code = app(standalone_mode=False)
        sys.stdout.flush()   # output to a file is block-buffered: a full disk shows here, not at interpreter exit
    except KeyboardInterrupt:   # outside the command's own call, which typer turns into Exit(130)
        code = 130
    except Exception as e:
        code = exit_code(e)
    signal.signal(signal.SIGINT, _interrupted_outside_a_command)
    if code == 130:
        # typer turns KeyboardInterrupt into Exit(130) and, outside standalone mode, returns it without a word;
        # no qbuild command exits 130 itself.
        err("interrupted")
    sys.stdout = stdout
    # The command is done: a Ctrl-C now changes nothing, and the interpreter's shutdown would die of it silently
    # (it puts back the default handler of every signal it handles, but not of an ignored one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code if isinstance(code, int) else 0)
