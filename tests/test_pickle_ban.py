"""Weights are only ever read from safetensors: the audit of every unpickling, and the rules it is judged by.

tests/test_e2e.py builds its three recipes (every family, a vision encoder, tp and ep) and runs the pulled VL bundle
on an image under the audit, and judges what it recorded with violations() below. The CLI and every worker it starts run with
tests/pickle_audit.py, which logs each call of
pickle.load / pickle.loads / pickle.Unpickler.load, each global a full unpickler resolves (the "pickle.find_class"
audit event of PEP 578, which also sees C code) and each torch.load, with its call stack. Two kinds are allowed:

- the process pool's own messages (jobs out, manifests back): bytes this build pickled a moment earlier in the
  driver or a worker, never read from a file;
- torch.export.load of a compiled graph (`.pt2`). A graph carries no weights (they are inputs of the program) and
  its constants (rotary tables, expert ids) are raw tensor bytes, but the archive keeps the example inputs it was
  traced with (`data/sample_inputs/model.pt`: zeros of the weights' shapes and the example arguments) as a
  torch.save pickle. torch reads it from the archive's bytes with its weights-only unpickler, which builds tensors
  and plain containers and refuses any other global. That is allowed in exactly that form: torch.load, weights_only,
  in-memory bytes, from torch's export deserializer. Its fallback to weights_only=False, or any torch.load of a
  file, fails the test.

Everything else, a torch.load or pickle.load of any file in particular, fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

STARTUP = Path(__file__).resolve().parent / "startup"
# The innermost callers (outside the loaders) through which the process pool unpickles its own messages.
POOL_IPC = ("qbuild.execution.executors.local:_receive",)
EXPORT_DESERIALIZER = "torch._export.serde.serialize:deserialize_torch_artifact"


def audited_env(log: Path) -> dict:
    return {"QBUILD_PICKLE_AUDIT": str(log), "PYTHONPATH": os.pathsep.join([str(STARTUP), str(REPO)])}


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _allowed(event: dict) -> bool:
    caller = event["stack"][0] if event["stack"] else ""
    if event["api"] == "torch.load":
        return event["weights_only"] and event["source"] == "bytes" and caller == EXPORT_DESERIALIZER
    return event["source"] in ("bytes", "?") and caller.startswith(POOL_IPC)


def violations(recorded: list[dict]) -> list[str]:
    """Each recorded unpickling the rules above do not allow, one line each."""
    return [f"{e['api']} {e['source']} weights_only={e['weights_only']} {e['detail']} via {' < '.join(e['stack'][:6])}"
            for e in recorded if not _allowed(e)]


CANARY = """\
import io, pickle, sys, torch
weights = sys.argv[1]
torch.save({"w": torch.zeros(2)}, weights)
torch.load(weights)
buffer = io.BytesIO()
torch.save(torch.Size([1]), buffer)
torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
pickle.loads(pickle.dumps([1]))
"""


def test_the_audit_sees_every_kind_of_unpickling(tmp_path):
    """The instrumentation itself: each forbidden load is recorded and refused, so an empty list means something."""
    log = tmp_path / "audit.log"
    subprocess.run([sys.executable, "-c", CANARY, str(tmp_path / "w.pt")], env=dict(os.environ, **audited_env(log)),
                   check=True)
    refused = {(e["api"], e["source"].split(":")[0], e["weights_only"], e["detail"])
               for e in events(log) if not _allowed(e)}
    assert ("torch.load", "file", True, "") in refused
    assert ("torch.load", "bytes", False, "") in refused
    assert ("pickle.find_class", "?", False, "torch.Size") in refused
    assert ("pickle.loads", "bytes", False, "") in refused

