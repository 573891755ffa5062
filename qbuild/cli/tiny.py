"""`qbuild tiny`: a tiny random checkpoint of a family, for tests and demos."""

from pathlib import Path

import typer

from qbuild.cli.exits import err
from qbuild.cli.options import JsonOpt, check_new_dir
from qbuild.core import jsonio
from qbuild.core.errors import UserError
from qbuild.model.families import FAMILIES


def tiny(family: str = typer.Argument(..., help=" | ".join(FAMILIES)),
         out: Path = typer.Argument(..., help="directory to write the checkpoint into (new or empty)"),
         seed: int = typer.Option(0, min=0, help="random seed (0 or more)"),
         fused_experts: bool = typer.Option(False, help="MoE experts in the fused 3D form"),
         force: bool = typer.Option(False, "--force", help="replace what a non-empty directory holds"),
         json_: bool = JsonOpt) -> None:
    """Write a tiny random checkpoint of a family (seeded, with a tokenizer) for tests and demos."""
    from qbuild.model.tinymodel import install_tiny_checkpoint

    if family not in FAMILIES:
        raise UserError(f"family: {family!r} is not one of {', '.join(FAMILIES)}")
    check_new_dir(out, "the checkpoint directory", None)   # install refuses a non-empty one unless replace
    install_tiny_checkpoint(out, family, replace=force, seed=seed, fused_experts=fused_experts)
    if json_:
        print(jsonio.dumps({"family": family, "path": str(out), "seed": seed, "fused_experts": fused_experts}))
    else:
        err(f"wrote a tiny {family} checkpoint to {out}")
