"""The action-cache manifest: what a key produced, and the preimage the key was computed from."""

from __future__ import annotations

from dataclasses import dataclass, field

from qbuild.core import jsonio
from qbuild.core.hashing import digest_json


def tree_digest(outputs: dict[str, dict]) -> str:
    """The digest of an output tree: its paths and blob digests (sizes follow from the blobs)."""
    return digest_json({p: o["digest"] for p, o in outputs.items()})


@dataclass(frozen=True)
class Manifest:
    key: str
    kind: str
    preimage: dict
    outputs: dict[str, dict]            # relative path -> {"digest": blake3 hex, "size": bytes}
    digest: str = ""                    # tree digest of outputs
    meta: dict = field(default_factory=dict)  # facts about the run (duration); not part of any key

    def __post_init__(self):
        if not self.digest:
            object.__setattr__(self, "digest", tree_digest(self.outputs))

    @property
    def size(self) -> int:
        return sum(o["size"] for o in self.outputs.values())

    def to_json(self) -> dict:
        return {"key": self.key, "kind": self.kind, "preimage": self.preimage, "outputs": self.outputs,
                "digest": self.digest, "meta": self.meta}

    def to_bytes(self) -> bytes:
        return jsonio.dumps(self.to_json(), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, doc: dict) -> "Manifest":
        return cls(key=doc["key"], kind=doc["kind"], preimage=doc["preimage"], outputs=doc["outputs"],
                   digest=doc["digest"], meta=doc.get("meta", {}))
