"""`qbuild run` and `qbuild bench`: generate with a bundle's compiled graphs, and time it over prompt lengths."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer

from qbuild.cli.options import (AllowUnverifiedOpt, JsonOpt, LockOpt, RemoteOpt, StoreOpt, StrictOpt, check_new_dir,
                                open_bundle)
from qbuild.core import jsonio
from qbuild.core.errors import UserError


@contextmanager
def _runtime(target: str, store: Optional[Path], lock: Path, remote: Optional[str], allow_unverified: bool,
             strict: bool) -> Iterator:
    """A Runtime for the bundle `target` names (options.open_bundle). Hardlinks are fine for a recipe's bundle laid
    out for it: nothing writes to it, and it is removed afterwards."""
    from qbuild.backends import load_runtime

    with open_bundle(target, store, lock, remote, allow_unverified, strict, share=True) as bundle:
        yield load_runtime(bundle.path, verify_digests=not bundle.digests_checked, shown_as=bundle.shown_as)


def _check_prompt_flags(prompt: Optional[str], prompt_ids: Optional[str]) -> None:
    if prompt is not None and prompt_ids is not None:
        raise UserError("--prompt and --prompt-ids: give one of them, not both")
    if prompt is None and prompt_ids is None:
        raise UserError("give --prompt TEXT or --prompt-ids 1,2,3")


def _prompt_ids(runtime, prompt: Optional[str], prompt_ids: Optional[str]) -> list[int]:
    if prompt_ids is None:
        return runtime.encode(prompt)
    try:
        ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--prompt-ids: {prompt_ids!r} is not a comma-separated list of token ids") from None
    vocab = runtime.arch.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:   # an id outside the embedding table would fail deep inside the graph
        raise UserError(f"--prompt-ids: token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})")
    return ids


def run(target: str = typer.Argument(..., help="a bundle directory (from `qbuild pull`), or a locked recipe"),
        prompt: Optional[str] = typer.Option(None, "--prompt", help="prompt text"),
        prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="prompt token ids, e.g. 1,2,3"),
        image: Optional[Path] = typer.Option(None, "--image", help="an image file (VL bundles)"),
        max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1, help="greedy tokens to generate"),
        json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
        remote: Optional[str] = RemoteOpt, allow_unverified: bool = AllowUnverifiedOpt,
        strict: bool = StrictOpt) -> None:
    """Generate greedily with a bundle's compiled graphs; report TTFT and TPOT."""
    from qbuild.render import generation_json, generation_text

    _check_prompt_flags(prompt, prompt_ids)
    if image is not None and not image.is_file():
        raise UserError(f"--image: {image} is not a file")
    if image is not None:   # refused before a bundle is loaded for it
        from qbuild.model.runtime.images import check_image

        check_image(image)
    with _runtime(target, store, lock, remote, allow_unverified, strict) as runtime:
        gen = runtime.generate(_prompt_ids(runtime, prompt, prompt_ids), max_new_tokens, image=image)
    if json_:
        print(jsonio.dumps(generation_json(gen), sort_keys=True))
    else:
        generation_text(gen)


def bench(target: str = typer.Argument(..., help="a bundle directory (from `qbuild pull`), or a locked recipe"),
          repeats: int = typer.Option(5, "--repeats", min=1, help="timed runs per prompt length"),
          warmup: int = typer.Option(1, "--warmup", min=0, help="untimed runs first"),
          new_tokens: Optional[int] = typer.Option(
              None, "--new-tokens", min=2,
              help="tokens generated per run; more than the KV cache holds after the longest prompt is refused "
                   "[default: 16, or as many as it holds]"),
          out: Optional[Path] = typer.Option(None, "--out", help="also write the JSON document here"),
          json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
          remote: Optional[str] = RemoteOpt, allow_unverified: bool = AllowUnverifiedOpt,
          strict: bool = StrictOpt) -> None:
    """Sweep prompt lengths 16, 64, 256, ... up to the largest CTE bucket; print TTFT / TPOT statistics."""
    from qbuild.render import bench_table
    from qbuild.model.runtime.bench import bench as run_bench, to_json

    if out is not None:   # refused before the bundle is laid out and the sweep runs
        check_new_dir(out.parent, "the --out file's directory", None)
        if out.is_dir():
            raise UserError(f"--out {out}: is a directory; name a file")
    with _runtime(target, store, lock, remote, allow_unverified, strict) as runtime:
        doc = to_json(run_bench(runtime, repeats=repeats, warmup=warmup, new_tokens=new_tokens), runtime.manifest)
    text = jsonio.dumps(doc, indent=1, sort_keys=True)
    if out is not None:
        from qbuild.core.files import atomic_write

        atomic_write(out, (text + "\n").encode())
    if json_:
        print(text)
    else:
        bench_table(doc)
