"""The hostile corpus: bad inputs and faulty machines, each answered the way the README promises.

Bad input (a recipe, a config, a checkpoint, a tokenizer, a lockfile) is one line naming the file and the field or
tensor, exit 2, and nothing written: no store, no lockfile. An infrastructure fault (the store, the disk, the remote)
is one error line, exit 3; afterwards the store is consistent and the next run finishes. Cases that used to hang
run under a timeout well above the time they now take. Every case runs the real CLI in a subprocess.

One module-scoped project holds a built tiny Qwen3.5 recipe (conftest's dense_project, "tiny-dense") and one whose
verify fails ("unverified"); the store and fault cases work on copies of it, so only the nodes a case changes are
ever built again.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import REPO, dense_project_stderr, qbuild, wait_until

STARTUP = REPO / "tests" / "startup"

# The cases on the module-scoped build `built` run on one worker, so it is built once; the others spread.
ONE_WORKER = pytest.mark.xdist_group("hostile-inputs")

FAMILY = "qwen3_next"
INDEX = "model.safetensors.index.json"
TEXT = "text: {seq_len: 32, cte_buckets: [16], tkg_buckets: [32]}"
RECIPE = """\
model: {{path: {path}}}
backend: export
dtype: float32
{text}
verify: {verify}
"""
VERIFY = {"new_tokens": 2, "prompts": ["Hello"], "top1_min": 0.5, "token_match_min": 0.5, "max_logit_err": 0.01}
# Progress lines a build prints on stderr before an error (plain lines when stderr is not a terminal).
PROGRESS = ("start  ", "built  ", "FAILED ", "skip   ", "CORRUPT ", "MISSING ")


def write_recipe(root: Path, name: str, checkpoint: Path, text: str = TEXT, **verify) -> Path:
    f = root / f"{name}.yaml"
    f.write_text(RECIPE.format(path=checkpoint, text=text, verify=json.dumps({**VERIFY, **verify})))
    return f


def files_under(root: Path) -> set[str]:
    """Every path under `root` but the per-test caches conftest points XDG_CACHE_HOME and HF_HOME at."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.relative_to(root).parts[0] not in ("xdg-cache", "hf-home")}


def store_state(store: Path) -> dict[str, int]:
    return {p.relative_to(store).as_posix(): p.stat().st_size if p.is_file() else -1 for p in store.rglob("*")}


def assert_one_line(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """Exit `code`, stderr exactly one `error:` line holding every fragment, no traceback anywhere."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stderr}"
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def assert_build_fault(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """A fault met while steps ran: its progress lines, then one `error:` line, last; no traceback and none of a
    library's own words."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stderr}"
    assert lines and lines[-1].startswith("error: "), proc.stderr
    others = lines[:-1]
    assert all(line.startswith(PROGRESS) or line[:1].isdigit() for line in others), proc.stderr
    assert "Traceback" not in proc.stderr and "inline_container" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


# --- bad input: nothing may be written -------------------------------------------------------------------------

def _shard_of(ck: Path, tensor: str) -> Path:
    return ck / json.loads((ck / INDEX).read_text())["weight_map"][tensor]


def _edit_header(path: Path, edit: Callable[[dict], None], extra: bytes = b"") -> None:
    """Rewrite a safetensors file's JSON header (and append `extra` bytes after its data)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:] + extra)


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


NORM = "model.norm.weight"


def truncated_shard(ck: Path):
    shard = _shard_of(ck, NORM)
    os.truncate(shard, shard.stat().st_size - 100)
    return shard.name, "truncated"


def lying_header_length(ck: Path):
    shard = _shard_of(ck, NORM)
    raw = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", struct.unpack("<Q", raw[:8])[0] + (1 << 20)) + raw[8:])
    return shard.name, "header length"


def lying_header_offsets(ck: Path):
    shard = _shard_of(ck, NORM)
    _edit_header(shard, lambda h: h[NORM].update(shape=[64, 2]))
    return shard.name, NORM


def header_not_json(ck: Path):
    shard = _shard_of(ck, NORM)
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    shard.write_bytes(raw[:8] + b"\xff" * n + raw[8 + n:])
    return shard.name, "not valid JSON"


def missing_tensor(ck: Path):
    _edit_header(_shard_of(ck, NORM), lambda h: h.pop(NORM))
    _edit_json(ck / INDEX, lambda d: d["weight_map"].pop(NORM))
    return NORM, "missing"


def extra_tensor(ck: Path):
    shard = _shard_of(ck, NORM)
    raw = shard.read_bytes()
    end = len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]   # data offsets count from the end of the header
    _edit_header(shard, lambda h: h.update({"model.surprise.weight": {"dtype": "F32", "shape": [4],
                                                                       "data_offsets": [end, end + 16]}}),
                 extra=b"\0" * 16)
    _edit_json(ck / INDEX, lambda d: d["weight_map"].update({"model.surprise.weight": shard.name}))
    return "model.surprise.weight", "not part of a qwen3_next checkpoint"


def misshapen_tensor(ck: Path):
    _edit_header(_shard_of(ck, NORM), lambda h: h[NORM].update(shape=[8, 8]))
    return NORM, "has shape (8, 8), expected (64,)"


def integer_tensor(ck: Path):
    _edit_header(_shard_of(ck, NORM), lambda h: h[NORM].update(dtype="I32"))
    return NORM, "floating-point"


def index_names_missing_shard(ck: Path):
    _edit_json(ck / INDEX, lambda d: d["weight_map"].update({NORM: "model-00099-of-00009.safetensors"}))
    return "model-00099-of-00009.safetensors", "not found"


def vocab_differs_from_embedding(ck: Path):
    _edit_json(ck / "config.json", lambda c: c.update(vocab_size=600))
    return "config.json", "vocab_size 600 does not match the 512 rows"


def eos_beyond_vocab(ck: Path):
    _edit_json(ck / "config.json", lambda c: c.update(eos_token_id=[505, 9999]))
    return "config.json", "eos_token_id"


def pad_id_not_an_integer(ck: Path):
    _edit_json(ck / "config.json", lambda c: c.update(pad_token_id="<pad>"))
    return "config.json", "pad_token_id"


def seq_len_beyond_positions(ck: Path):
    _edit_json(ck / "config.json", lambda c: c.update(max_position_embeddings=16))
    return "text.seq_len", "max_position_embeddings 16"


def config_is_a_fifo(ck: Path):
    (ck / "config.json").unlink()
    os.mkfifo(ck / "config.json")
    return "config.json", "regular file"


def config_is_endless(ck: Path):
    (ck / "config.json").unlink()
    (ck / "config.json").symlink_to("/dev/zero")
    return "config.json", "regular file"


def config_not_utf8(ck: Path):
    (ck / "config.json").write_bytes(b'{"model_type": "qwen3_next\xff"}')
    return "config.json", "cannot read config.json"


def tokenizer_missing(ck: Path):
    (ck / "tokenizer.json").unlink()
    return str(ck), "no tokenizer"


def tokenizer_unloadable(ck: Path):
    (ck / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    return "tokenizer.json", "cannot be loaded"


def tokenizer_beyond_vocab(ck: Path):
    token = {"id": 700, "content": "<|beyond|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
    _edit_json(ck / "tokenizer.json", lambda t: t["added_tokens"].append(token))
    return "tokenizer.json", "'<|beyond|>' has id", "not below config.json's vocab_size 512"


def tokenizer_config_broken(ck: Path):
    (ck / "tokenizer_config.json").write_text("{not json")
    return "tokenizer_config.json", "not valid JSON"


CHECKPOINT_CASES = [truncated_shard, lying_header_length, lying_header_offsets, header_not_json, missing_tensor,
                    extra_tensor, misshapen_tensor, integer_tensor, index_names_missing_shard,
                    vocab_differs_from_embedding, eos_beyond_vocab, pad_id_not_an_integer, seq_len_beyond_positions,
                    config_is_a_fifo, config_is_endless, config_not_utf8, tokenizer_missing, tokenizer_unloadable,
                    tokenizer_beyond_vocab, tokenizer_config_broken]


@pytest.mark.parametrize("corrupt", CHECKPOINT_CASES, ids=lambda f: f.__name__)
@pytest.mark.slow
def test_bad_checkpoint_is_one_line_exit_2_and_nothing_written(corrupt, small_checkpoints, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(small_checkpoints[FAMILY], ck)
    names = corrupt(ck)
    recipe = write_recipe(tmp_path, "r", ck)
    before = files_under(tmp_path)
    proc = qbuild("compile", str(recipe), "--store", "store", cwd=tmp_path, timeout=60)
    assert_one_line(proc, 2, *names)
    assert files_under(tmp_path) == before, "a bad checkpoint wrote something"


VL = "qwen3_5"


@pytest.mark.parametrize("edit,fragment", [
    (lambda c: c.update(image_token_id=9999), "image_token_id is 9999"),
    (lambda c: c.update(vision_end_token_id=-1), "vision_end_token_id"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_interleaved=False), "mrope_interleaved"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 2]), "mrope_section"),
], ids=["image-token-beyond-vocab", "vision-end-token-negative", "mrope-not-interleaved", "mrope-section-of-two"])
def test_bad_vl_config_is_one_line_exit_2_and_nothing_written(edit, fragment, small_checkpoints, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(small_checkpoints[VL], ck)
    _edit_json(ck / "config.json", edit)
    recipe = write_recipe(tmp_path, "r", ck)
    before = files_under(tmp_path)
    proc = qbuild("compile", str(recipe), "--store", "store", cwd=tmp_path, timeout=60)
    assert_one_line(proc, 2, "config.json", fragment)
    assert files_under(tmp_path) == before


def _bomb() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


RECIPE_CASES = {
    # name: (write the recipe under test into the directory, fragments of the message)
    "extends-dev-zero": (lambda d: "extends: /dev/zero\n", ("extends: /dev/zero is not a regular file",)),
    "extends-fifo": (lambda d: os.mkfifo(d / "base.yaml") or "extends: base.yaml\n", ("base.yaml", "regular file")),
    "extends-directory": (lambda d: (d / "base").mkdir() or "extends: base\n", ("extends: base",)),
    "yaml-alias-bomb": (lambda d: _bomb(), ("YAML aliases",)),
    "not-utf8": (lambda d: b"model: {path: ck}\nname: caf\xe9\n", ("not UTF-8",)),
    "over-1-MiB": (lambda d: "# padding\n" * 120_000, ("larger than 1 MiB",)),
    "nested-too-deep": (lambda d: "model: " + "[" * 50_000 + "]" * 50_000 + "\n", ("nested too deeply",)),
    "key-is-a-list": (lambda d: "{[a, b]: 1}\n", ("a key must be a plain name",)),
}


@pytest.mark.parametrize("name", sorted(RECIPE_CASES))
def test_hostile_recipe_is_one_line_exit_2_and_nothing_written(name, tmp_path):
    write, fragments = RECIPE_CASES[name]
    content = write(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = files_under(tmp_path)
    # The subprocess timeout is the guard against a parser that never returns (a hang fails the test); how fast a
    # refusal comes is the machine's business, not the test's.
    proc = qbuild("compile", str(recipe), "--store", "store", cwd=tmp_path, timeout=120)
    assert_one_line(proc, 2, str(recipe), *fragments)
    assert files_under(tmp_path) == before


def test_recipe_that_is_a_fifo_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "r.yaml")
    proc = qbuild("compile", "r.yaml", "--store", "store", cwd=tmp_path, timeout=60)
    assert_one_line(proc, 2, "r.yaml", "must be a regular file")
    assert not (tmp_path / "store").exists() and not (tmp_path / "artifacts.lock").exists()


def test_lockfile_that_is_a_fifo_is_refused_at_once(small_checkpoints, tmp_path):
    recipe = write_recipe(tmp_path, "r", small_checkpoints[FAMILY])
    os.mkfifo(tmp_path / "artifacts.lock")
    proc = qbuild("plan", str(recipe), "--store", "store", cwd=tmp_path, timeout=60)
    assert_one_line(proc, 2, "artifacts.lock", "must be a regular file")


@pytest.mark.parametrize("command", [["plan", "r.yaml"], ["compile", "r.yaml"], ["store", "verify"], ["gc"]])
def test_store_naming_a_file_is_one_line_exit_3(command, small_checkpoints, tmp_path):
    write_recipe(tmp_path, "r", small_checkpoints[FAMILY])
    (tmp_path / "artifacts.lock").write_text(json.dumps({"version": 1, "recipes": {}, "nodes": {}}))
    (tmp_path / "not-a-dir").write_text("x")
    lock_before = (tmp_path / "artifacts.lock").read_bytes()
    proc = qbuild(*command, "--store", "not-a-dir", cwd=tmp_path, timeout=60)
    assert_one_line(proc, 3, "not-a-dir", "not a directory")
    assert (tmp_path / "artifacts.lock").read_bytes() == lock_before


# --- hostile paths: links, weight files that are not files, images, signals, stdout, the working directory -----

def test_recipe_that_is_a_symlink_loop_is_one_line_exit_2(tmp_path):
    (tmp_path / "r.yaml").symlink_to("r.yaml")
    (tmp_path / "child.yaml").write_text("extends: r.yaml\n")
    for recipe, fragment in (("r.yaml", "symbolic links form a loop"), ("child.yaml", "extends: r.yaml is a symbolic")):
        for command in (["plan", recipe], ["recipe", "validate", recipe]):
            proc = qbuild(*command, "--store", "store", cwd=tmp_path, timeout=60) if command[0] == "plan" else \
                qbuild(*command, cwd=tmp_path, timeout=60)
            assert_one_line(proc, 2, recipe, fragment)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ("xdg-cache", "hf-home")) == \
        ["child.yaml", "r.yaml"]


def test_model_path_that_is_a_symlink_loop_is_one_line_exit_2(tmp_path):
    (tmp_path / "ck").symlink_to("ck")
    recipe = write_recipe(tmp_path, "r", Path("ck"))
    before = files_under(tmp_path)
    for command in (["plan", str(recipe), "--store", "store"], ["recipe", "validate", str(recipe)],
                    ["compile", str(recipe), "--store", "store"]):
        assert_one_line(qbuild(*command, cwd=tmp_path, timeout=60), 2, f"{recipe}:1:15: model.path: ck is a symbolic "
                                                                          "link loop")
    assert files_under(tmp_path) == before


def _first_shard(ck: Path) -> tuple[str, str]:
    """(the first tensor the index maps to the first shard, that shard's file name)."""
    weight_map = json.loads((ck / INDEX).read_text())["weight_map"]
    shard = min(weight_map.values())
    return min(t for t, f in weight_map.items() if f == shard), shard


def _point_index(ck: Path, target: str) -> None:
    _, shard = _first_shard(ck)
    _edit_json(ck / INDEX, lambda d: d["weight_map"].update({t: target for t, f in d["weight_map"].items()
                                                             if f == shard}))


def index_names_dev_zero(ck: Path):
    _point_index(ck, "/dev/zero")
    return "weight_map[", "is '/dev/zero': a weight file must be a file name in the checkpoint directory"


def index_names_a_shard_outside(ck: Path):
    _, shard = _first_shard(ck)
    shutil.move(ck / shard, ck.parent / "outside.safetensors")
    _point_index(ck, "../outside.safetensors")
    return "is '../outside.safetensors': a weight file must be a file name"


def index_names_an_absolute_path(ck: Path):
    _, shard = _first_shard(ck)
    outside = Path(shutil.move(ck / shard, ck.parent / "outside.safetensors"))
    _point_index(ck, str(outside))
    return f"is '{outside}': a weight file must be a file name"


def shard_is_a_device(ck: Path):
    tensor, shard = _first_shard(ck)
    (ck / shard).unlink()
    (ck / shard).symlink_to("/dev/zero")
    return f"weight_map[{tensor!r}] names {shard}, which is a device, not a regular file"


def shard_is_a_fifo(ck: Path):
    tensor, shard = _first_shard(ck)
    (ck / shard).unlink()
    os.mkfifo(ck / shard)
    return f"weight_map[{tensor!r}] names {shard}, which is a FIFO"


def index_is_a_device(ck: Path):
    (ck / INDEX).unlink()
    (ck / INDEX).symlink_to("/dev/zero")
    return INDEX, "must be a regular file"


def index_is_a_fifo(ck: Path):
    (ck / INDEX).unlink()
    os.mkfifo(ck / INDEX)
    return INDEX, "must be a regular file"


WEIGHT_FILE_CASES = [index_names_dev_zero, index_names_a_shard_outside, index_names_an_absolute_path,
                     shard_is_a_device, shard_is_a_fifo, index_is_a_device, index_is_a_fifo]


@pytest.mark.parametrize("corrupt", WEIGHT_FILE_CASES, ids=lambda f: f.__name__)
def test_weight_index_naming_what_is_not_a_weight_file_is_one_line_exit_2(corrupt, small_checkpoints, tmp_path):
    """Before these were checked a device or FIFO was "not found", and an index that is itself a device was passed
    over: the shards converted while transformers, which reads the index, failed the reference step (exit 1)."""
    ck = tmp_path / "ck"
    shutil.copytree(small_checkpoints["qwen3_5"], ck)
    fragments = corrupt(ck)
    recipe = write_recipe(tmp_path, "r", ck)
    before = files_under(tmp_path)
    proc = qbuild("compile", str(recipe), "--store", "store", cwd=tmp_path, timeout=120)
    assert_one_line(proc, 2, str(ck), *fragments)
    assert files_under(tmp_path) == before


def _png(path: Path, width: int, height: int) -> None:
    """A valid PNG header declaring width x height RGB pixels, with a few compressed rows: kilobytes on disk, however
    many pixels it declares (a decompression bomb)."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress((b"\0" + b"\0" * 3 * width) * 4, 9)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


@pytest.mark.parametrize("width,height,declared", [(100_000, 100_000, "10000000000 pixels"),
                                                   (9000, 9000, "81000000 pixels")],
                         ids=["over-twice-pils-limit", "between-the-limit-and-twice-it"])
def test_decompression_bomb_image_is_refused_before_decoding(tmp_path, width, height, declared):
    """PIL only warns between its limit and twice it (and then decodes); the explicit limit refuses both, from the
    CLI before any bundle is loaded, and from the runtime's own reader."""
    from qbuild.core.errors import UserError
    from qbuild.model.runtime.images import MAX_IMAGE_PIXELS, pixels

    bomb = tmp_path / "bomb.png"
    _png(bomb, width, height)
    assert bomb.stat().st_size < 1 << 20 and width * height > MAX_IMAGE_PIXELS
    proc = qbuild("run", "some-recipe", "--prompt", "hi", "--image", str(bomb), cwd=tmp_path, timeout=60)
    assert_one_line(proc, 2, str(bomb), f"declares {declared}", "refusing to decode it")
    with pytest.raises(UserError, match="declares"):
        pixels(None, bomb)


def test_an_image_within_the_limit_is_decoded(tmp_path):
    from PIL import Image

    from qbuild.model.runtime.images import MAX_IMAGE_PIXELS, check_image

    path = tmp_path / "ok.png"
    Image.new("RGB", (8192, 8192)).save(path)
    assert 8192 * 8192 == MAX_IMAGE_PIXELS
    check_image(path)


HOLD_IMPORT = """\
import os, signal, sys


class _Hold:
    # Holds the import of $QBUILD_TEST_HOLD until a signal ends the process, so SIGINT lands exactly there; the line
    # on the inherited pipe tells the test that the command got there.
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["QBUILD_TEST_HOLD"]:
            os.write(int(os.environ["QBUILD_TEST_READY_FD"]), b"ready\\n")
            while True:
                signal.pause()
        return None


sys.meta_path.insert(0, _Hold())
"""


@pytest.mark.parametrize("held", ["typer", "qbuild.execution.workspace", "qbuild.planning.plan"],
                         ids=["while-the-cli-loads", "as-the-command-starts", "while-planning"])
def test_sigint_during_plan_exits_130_with_one_line(held, small_checkpoints, tmp_path):
    recipe = write_recipe(tmp_path, "r", small_checkpoints[FAMILY])
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_IMPORT)
    ready_r, ready_w = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), str(REPO)]), QBUILD_TEST_HOLD=held,
               QBUILD_TEST_READY_FD=str(ready_w))
    proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", "plan", str(recipe), "--store", "store"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            pass_fds=(ready_w,))
    os.close(ready_w)
    try:
        with os.fdopen(ready_r, "rb") as ready:
            assert select.select([ready], [], [], 60)[0] and ready.readline() == b"ready\n", \
                f"the command never imported {held}"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and stderr == "interrupted\n" and stdout == "", (proc.returncode, stderr)
    assert not (tmp_path / "store").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize("args", [["plan", "r.yaml"], ["plan", "r.yaml", "--json"], ["recipe", "schema"]],
                         ids=["plan", "plan-json", "recipe-schema"])
def test_stdout_that_cannot_be_written_is_one_line_exit_3(args, small_checkpoints, tmp_path):
    write_recipe(tmp_path, "r", small_checkpoints[FAMILY])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "qbuild.cli", *args], cwd=tmp_path, env=env, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr == "error: stdout: cannot write the output: No space left on device\n", proc.stderr


def test_a_closed_stdout_is_one_line_exit_3(small_checkpoints, tmp_path):
    write_recipe(tmp_path, "r", small_checkpoints[FAMILY])
    proc = subprocess.run([sys.executable, "-m", "qbuild.cli", "plan", "r.yaml", "--json"], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=subprocess.PIPE, text=True, timeout=120,
                          preexec_fn=lambda: os.close(1))   # `qbuild plan >&-`
    assert proc.returncode == 3 and proc.stderr == "error: stdout: cannot write the output: stdout is closed\n", \
        proc.stderr


@pytest.mark.parametrize("args", [["plan", "--all"], ["gc"], ["store", "verify"], ["tiny", "qwen3_5", "ck"],
                                  ["recipe", "validate", "r.yaml"]])
def test_commands_run_from_a_deleted_directory_are_one_line_exit_3(args, tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # The child removes its own working directory, then runs the command there (as after `rm -rf` of the cwd).
    code = ("import os, runpy, sys\n"
            f"os.chdir({str(gone)!r}); os.rmdir({str(gone)!r})\n"
            f"sys.argv = ['qbuild', *{args!r}]\n"
            "runpy.run_module('qbuild.cli', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert_one_line(proc, 3, "the current directory is gone")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ("xdg-cache", "hf-home")) == []


# --- a built project, and faults of its store ------------------------------------------------------------------

OK = "tiny-dense"                       # conftest's dense_project recipe: its name and its file
OK_RECIPE = "recipes/tiny-dense.yaml"
BUILT_TEXT = "text: {seq_len: 48, cte_buckets: [32], tkg_buckets: [48]}"   # its buckets: recipes on top share graphs


@pytest.fixture(scope="module")
def built(dense_project, small_checkpoints, tmp_path_factory):
    """A project (recipes, store, lockfile) where "tiny-dense" is built and verified (a copy of conftest's
    dense_project, built without -v), and "unverified" (other prompts, an impossible threshold) failed its verify,
    built with -v."""
    root = Path(shutil.copytree(dense_project, tmp_path_factory.mktemp("built") / "project", symlinks=True))
    ck = small_checkpoints["qwen3_5"]
    write_recipe(root / "recipes", "unverified", ck, text=BUILT_TEXT, prompts=["Hi there"], max_logit_err=1e-12)
    # conftest's per-test isolation is not in force yet while a module fixture is set up: the same, by hand
    caches = tmp_path_factory.mktemp("built-caches")
    env = {"QBUILD_STORE": str(root / "store"), "XDG_CACHE_HOME": str(caches / "xdg"),
           "HF_HOME": str(caches / "hf"), "HF_HUB_CACHE": "", "HF_HUB_OFFLINE": "1", "QBUILD_REMOTE": ""}
    verbose = qbuild("compile", "recipes/unverified.yaml", "-v", cwd=root, env=env, timeout=600)
    assert verbose.returncode == 1, verbose.stderr
    return {"root": root, "checkpoint": ck, "quiet": dense_project_stderr(dense_project), "verbose": verbose.stderr}


def copy_project(built: dict, dest: Path) -> Path:
    shutil.copytree(built["root"], dest, symlinks=True)
    return dest


def locked(project: Path, recipe: str, role: str) -> dict:
    doc = json.loads((project / "artifacts.lock").read_text())
    return doc["nodes"][doc["recipes"][recipe]["nodes"][role]]


@ONE_WORKER
@pytest.mark.slow
def test_library_output_stays_off_the_terminal_and_v_shows_it(built):
    quiet, verbose = built["quiet"], built["verbose"]
    for noise in ("Loading weights", "FutureWarning", "[transformers]"):
        assert noise not in quiet, quiet
    assert "  | Loading weights" in verbose and "  | [transformers]" in verbose, verbose
    key = locked(built["root"], OK, "reference")["key"]
    output = json.loads((built["root"] / "store" / "ac" / key[:2] / f"{key}.json").read_text())["meta"]["output"]
    assert any(line.startswith("Loading weights") for line in output)


@ONE_WORKER
@pytest.mark.slow
def test_the_lockfile_leaves_no_lock_file_beside_it(built):
    assert sorted(p.name for p in built["root"].iterdir()) == ["artifacts.lock", "recipes", "store"]
    assert sorted(p.name for p in (built["root"] / "recipes").iterdir()) == ["tiny-dense.yaml", "unverified.yaml"]


@ONE_WORKER
@pytest.mark.slow
def test_pull_refuses_an_unverified_bundle_naming_the_failed_report(built, tmp_path):
    project = copy_project(built, tmp_path / "p")
    proc = qbuild("pull", "unverified", "--to", "bundle", cwd=project, env={"QBUILD_STORE": str(project / "store")})
    assert_one_line(proc, 2, "unverified", "not verified", "max |logit error|", "--allow-unverified")
    assert not (project / "bundle").exists() and not list(project.glob(".bundle*"))
    proc = qbuild("pull", "unverified", "--to", "bundle", "--allow-unverified", cwd=project,
                  env={"QBUILD_STORE": str(project / "store")})
    assert proc.returncode == 0, proc.stderr
    assert (project / "bundle" / "bundle.json").is_file()
    proc = qbuild("pull", OK, "--to", "ok-bundle", cwd=project, env={"QBUILD_STORE": str(project / "store")})
    assert proc.returncode == 0, proc.stderr


@ONE_WORKER
@pytest.mark.slow
def test_blob_replaced_by_a_directory_is_repaired_by_the_next_build(built, tmp_path):
    project = copy_project(built, tmp_path / "p")
    store = project / "store"
    digest = locked(project, OK, "shard")["outputs"]["weights/tp0_sharded_checkpoint.safetensors"]["digest"]
    blob = store / "cas" / digest[:2] / digest
    blob.unlink()
    (blob / "squatter").mkdir(parents=True)
    env = {"QBUILD_STORE": str(store)}
    # store verify names the squatter (no traceback); --repair drops it and the entries that lost it.
    proc = qbuild("store", "verify", cwd=project, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and f"corrupt blob {blob}" in proc.stdout + \
        proc.stderr, proc.stdout + proc.stderr
    assert qbuild("store", "verify", "--repair", cwd=project, env=env).returncode in (0, 1)
    assert not blob.exists()
    proc = qbuild("compile", OK_RECIPE, "--json", cwd=project, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert blob.is_file() and "shard cpu 1 rank" in json.loads(proc.stdout)["built"]
    assert qbuild("lock", "check", cwd=project, env=env).returncode == 0
    assert qbuild("store", "verify", cwd=project, env=env).returncode == 0


@ONE_WORKER
@pytest.mark.slow
def test_manifest_replaced_by_a_fifo_neither_hangs_nor_stays(built, tmp_path):
    project = copy_project(built, tmp_path / "p")
    store = project / "store"
    key = locked(project, OK, "shard")["key"]
    manifest = store / "ac" / key[:2] / f"{key}.json"
    manifest.unlink()
    os.mkfifo(manifest)
    proc = qbuild("compile", OK_RECIPE, "--json", cwd=project, env={"QBUILD_STORE": str(store)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert manifest.is_file() and "shard cpu 1 rank" in json.loads(proc.stdout)["built"], proc.stdout


def _read_only(path: Path):
    """Make `path` read-only for this process: a read-only bind mount as root (root ignores permission bits), else
    the permission bits. Returns a function that undoes it, or None where neither is possible."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
        return lambda: subprocess.run(["chmod", "-R", "u+w", str(path)], check=True)
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
        return None
    if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", str(path)], check=False)
        return None
    return lambda: subprocess.run(["umount", str(path)], check=True)


@ONE_WORKER
@pytest.mark.slow
def test_read_only_store_is_one_line_exit_3_then_the_next_run_finishes(built, tmp_path):
    project = copy_project(built, tmp_path / "p")
    store = project / "store"
    write_recipe(project, "other", built["checkpoint"], text=BUILT_TEXT, top1_min=0.25)   # only its verify is new
    (project / "empty.lock").write_text(json.dumps({"version": 1, "recipes": {}, "nodes": {}}))
    lock_before, state_before = (project / "artifacts.lock").read_bytes(), store_state(store)
    undo = _read_only(store)
    if undo is None:
        pytest.skip("cannot make a directory read-only here")
    try:
        proc = qbuild("compile", "other.yaml", cwd=project, env={"QBUILD_STORE": str(store)}, timeout=120)
        assert_one_line(proc, 3, str(store), "cannot write to the store")
        # with no lockfile naming anything, gc would remove every entry; on a read-only store it removes none
        proc = qbuild("gc", "--keep-size", "0", "--grace", "0", "--lock", "empty.lock", cwd=project,
                      env={"QBUILD_STORE": str(store)})
        assert_one_line(proc, 3, str(store), "Read-only file system" if os.geteuid() == 0 else "Permission")
    finally:
        undo()
    assert (project / "artifacts.lock").read_bytes() == lock_before and store_state(store) == state_before
    proc = qbuild("compile", "other.yaml", "--json", cwd=project, env={"QBUILD_STORE": str(store)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["built"] == ["verify other"]


NEW_BUCKET = "text: {seq_len: 48, cte_buckets: [8, 32], tkg_buckets: [48]}"   # one new graph: compile cte-8


@ONE_WORKER
@pytest.mark.slow
def test_full_disk_during_compile_is_one_line_exit_3_then_the_next_run_finishes(built, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = sum(p.stat().st_size for p in (built["root"] / "store").rglob("*") if p.is_file()) + (4 << 20)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs is not permitted here")
    try:
        project = copy_project(built, tmp_path / "p")
        store = Path(shutil.move(project / "store", mnt / "store"))   # only the store is on the small disk
        write_recipe(project, "wide", built["checkpoint"], text=NEW_BUCKET)
        st = os.statvfs(mnt)
        with open(mnt / "filler", "wb") as f:   # leave 64 KiB: less than one compiled graph
            f.write(b"\0" * (st.f_bavail * st.f_frsize - (64 << 10)))
        proc = qbuild("compile", "wide.yaml", cwd=project, env={"QBUILD_STORE": str(store)}, timeout=300)
        assert_build_fault(proc, 3, "compile cte-8", "no space left on device", str(store))
        check = qbuild("store", "verify", "--json", cwd=project, env={"QBUILD_STORE": str(store)})
        assert json.loads(check.stdout)["problems"] == [], check.stdout
        (mnt / "filler").unlink()
        proc = qbuild("compile", "wide.yaml", "--json", cwd=project, env={"QBUILD_STORE": str(store)}, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert sorted(json.loads(proc.stdout)["built"]) == ["compile cte-8 (export)", "package wide", "verify wide"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@ONE_WORKER
@pytest.mark.slow
def test_sigkill_of_the_driver_ends_its_workers(built, tmp_path):
    import psutil

    project = copy_project(built, tmp_path / "p")
    write_recipe(project, "wide", built["checkpoint"], text=NEW_BUCKET)
    # tests/crash_points.py holds the compile step in its worker, once started, until it is killed; the key it
    # writes to the marker says the worker is there to be watched.
    marker = tmp_path / "compile-started"
    env = dict(os.environ, QBUILD_STORE=str(project / "store"), QBUILD_CRASH_AT="compile:start",
               QBUILD_CRASH_MARKER=str(marker), PYTHONPATH=os.pathsep.join([str(STARTUP), str(REPO)]))
    driver = subprocess.Popen([sys.executable, "-m", "qbuild.cli", "compile", "wide.yaml"], cwd=project, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    descendants: list = []
    try:
        wait_until(lambda: marker.exists() or driver.poll() is not None, 120, "the compile step to start")
        assert marker.exists(), f"the build ended before its compile step started:\n{driver.stderr.read()}"
        descendants = psutil.Process(driver.pid).children(recursive=True)
        assert descendants, "no worker was started"
        driver.kill()
        driver.wait(timeout=10)
        start = time.monotonic()
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert alive == [], f"still running {time.monotonic() - start:.1f}s after the driver died: {alive}"
    finally:
        if driver.poll() is None:
            driver.kill()
        for p in descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


# --- the remote ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_remote_that_accepts_and_never_answers_fails_in_under_30s_naming_the_endpoint(small_checkpoints, tmp_path):
    from tests.s3server import s3_env

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    port = server.getsockname()[1]
    held: list[socket.socket] = []

    def accept_and_say_nothing():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    recipe = write_recipe(tmp_path, "r", small_checkpoints[FAMILY])
    env = {**s3_env(f"http://127.0.0.1:{port}"), "XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}
    try:
        proc = subprocess.run([sys.executable, "-m", "qbuild.cli", "plan", str(recipe), "--store", "store",
                               "--remote", "s3://bucket/prefix"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)
    finally:
        server.close()
        for conn in held:
            conn.close()
    assert_one_line(proc, 3, "s3://bucket/prefix/", f"127.0.0.1:{port}", "stopped answering")
    # Without qbuild's own timeouts (CONNECT_TIMEOUT_S, READ_TIMEOUT_S) botocore would wait 60 s per read and retry;
    # the 60 s subprocess timeout above fails the test in that case, whatever the machine's speed.
    assert held, "the client never connected"


# --- transformers as the oracle, packaging, CI -----------------------------------------------------------------

def test_config_without_mrope_section_rotates_as_transformers_does(small_checkpoints):
    """transformers' Qwen3.5 text rotary defaults mrope_section to [11, 11, 10] and always interleaves: image
    positions (t, h, w differ) must get the same cos/sin from qbuild's model."""
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from qbuild.model.arch import arch_from_config
    from qbuild.model.modeling.model import RotaryEmbedding

    text = json.loads((small_checkpoints[VL] / "config.json").read_text())["text_config"]
    text["head_dim"] = 64
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    text = {k: v for k, v in text.items() if k not in ("model_type", "transformers_version", "dtype")}
    ours = RotaryEmbedding(arch_from_config({**text, "model_type": "qwen3_5_text"}))
    theirs = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**text))
    positions = torch.stack([torch.arange(12), torch.arange(12) // 4, torch.arange(12) % 4])[:, None]
    cos, sin = theirs(torch.zeros(1, 12, 64), positions)
    our_cos, our_sin = ours(positions)
    torch.testing.assert_close(our_cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(our_sin, sin, rtol=0, atol=1e-6)


def test_neuron_extra_installs_everything_but_torch():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(r.startswith("torch") for r in extras["neuron"])
    assert sorted(extras["neuron"]) == sorted(r for r in extras["build"] if not r.startswith("torch"))


def _actionlint() -> str | None:
    found = shutil.which("actionlint") or Path(sys.executable).with_name("actionlint")
    return str(found) if found and Path(found).exists() else None


def test_publish_workflow_passes_actionlint():
    exe = _actionlint()
    if exe is None:
        pytest.skip("actionlint not found (the test extra installs it: pip install -e '.[test]')")
    proc = subprocess.run([exe, "-no-color", ".github/workflows/publish.yml"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
