"""The Neuron SDK releases a neuron recipe may pin, each with the exact versions of the four Python distributions a
compile runs (docs/neuron-sdk.md, read from the SDK's own package manifest: aws-neuron/aws-neuron-sdk
src/helperscripts/n2-manifest.json @ a3247f5b8c30). A recipe names a release (`toolchain: {sdk: "2.30.0"}`) or the
four versions; a set mixed from several releases is refused naming the release each version belongs to, since no
standard host has it.

Pure data: nothing here imports the SDK.
"""

from __future__ import annotations

# distribution -> the recipe's toolchain field that pins it
FIELDS = {"neuronx-cc": "neuronx_cc", "neuronx-distributed": "neuronx_distributed",
          "neuronx-distributed-inference": "neuronx_distributed_inference", "torch-neuronx": "torch_neuronx"}


def _release(cc: str, nxd: str, nxdi: str, torch_neuronx: str) -> dict[str, str]:
    return {"neuronx-cc": cc, "neuronx-distributed": nxd, "neuronx-distributed-inference": nxdi,
            "torch-neuronx": torch_neuronx}


# The releases of the NxDI era whose torch-neuronx is built on torch 2.8 or 2.9 (what the Qwen3.5 ports import).
RELEASES: dict[str, dict[str, str]] = {
    "2.27.0": _release("2.22.12471.0", "0.16.25997", "0.7.14366", "2.8.0.2.11.19912"),
    "2.27.1": _release("2.22.12471.0", "0.16.25997", "0.7.15063", "2.8.0.2.11.19912"),
    "2.28.0": _release("2.23.6484.0", "0.17.26814", "0.8.16251", "2.8.0.2.12.22436"),
    "2.28.1": _release("2.23.6484.0", "0.17.26814", "0.8.16251", "2.8.0.2.12.22436"),
    "2.29.0": _release("2.24.5133.0", "0.18.27753", "0.9.17334", "2.9.0.2.13.24727"),
    "2.29.1": _release("2.24.8799.0", "0.18.27753", "0.9.17334", "2.9.0.2.13.26312"),
    "2.30.0": _release("2.25.3371.0", "0.19.28093", "0.10.17970", "2.9.0.2.14.27725"),
    "2.31.0": _release("2.26.6360.0", "0.19.28492", "0.10.18399", "2.9.0.2.15.32035"),
    "2.31.1": _release("2.26.6360.0", "0.19.28492", "0.10.18399", "2.9.0.2.15.32035"),
}


class ToolchainError(ValueError):
    """A toolchain that names no release: `field` is the recipe's toolchain field at fault."""

    def __init__(self, field: str, msg: str):
        super().__init__(f"{field}: {msg}")
        self.field, self.msg = field, msg


def same_version(installed: str, pin: str) -> bool:
    """Whether an installed (or pinned) version is the release's: wheels carry a local suffix
    (0.10.18399+ed62453e: NxDI setup.py get_version @ c63afe0), and a pin may drop trailing components
    (2.25.3371 for 2.25.3371.0)."""
    public = installed.split("+", 1)[0]
    return public == pin or public.startswith(pin + ".") or pin.startswith(public + ".")


def releases_of(dist: str, version: str) -> list[str]:
    """The releases that ship `version` of `dist`, oldest first."""
    return [name for name, pins in RELEASES.items() if same_version(version, pins[dist])]


def resolve(sdk: str | None, pins: dict[str, str | None], from_source: tuple[str, ...] = ()) -> dict[str, str]:
    """The exact four versions a recipe's toolchain names; ToolchainError where it names no release, or versions of
    several. `from_source` names distributions installed from a source tree rather than a
    release (their pin is taken as written, and belongs to no release)."""
    if sdk is not None:
        if sdk not in RELEASES:
            raise ToolchainError("sdk", f"{sdk!r} is not a Neuron SDK release qbuild knows ({', '.join(RELEASES)})")
        release = RELEASES[sdk]
        out = {}
        for dist, field in FIELDS.items():
            pin = pins.get(dist)
            if dist in from_source:
                if pin is None:
                    raise ToolchainError(field, "installed from source, so its version must be pinned")
                out[dist] = pin
            elif pin is None or same_version(release[dist], pin):
                out[dist] = release[dist]
            else:
                where = releases_of(dist, pin)
                raise ToolchainError(field, f"{pin} is not SDK {sdk}'s ({release[dist]})"
                                     + (f"; it ships with SDK {', '.join(where)}" if where else
                                        "; no SDK release ships it (list it in toolchain.from_source if it is "
                                        "installed from a source tree)"))
        return out
    missing = [FIELDS[d] for d in FIELDS if pins.get(d) is None]
    if missing:
        raise ToolchainError(missing[0], f"a neuron build pins the Neuron SDK: set toolchain.sdk (e.g. "
                                         f"{list(RELEASES)[-1]!r}) or all four versions")
    candidates = None
    belongs = {}
    for dist, field in FIELDS.items():
        if dist in from_source:
            continue
        where = releases_of(dist, pins[dist])
        belongs[field] = where
        candidates = set(where) if candidates is None else candidates & set(where)
    if candidates is not None and not candidates:
        parts = [f"{field} {pins[dist]} ({'SDK ' + ', '.join(belongs[field]) if belongs[field] else 'no release'})"
                 for dist, field in FIELDS.items() if field in belongs]
        raise ToolchainError("sdk", f"the toolchain mixes Neuron SDK releases: {'; '.join(parts)}; name one "
                                    "release with toolchain.sdk")
    if candidates is None:          # every distribution is from source
        return {dist: pins[dist] for dist in FIELDS}
    # Spelled out as the release has it, so that `2.26.6360` and `2.26.6360.0` make one key.
    release = RELEASES[min(candidates, key=list(RELEASES).index)]
    return {dist: pins[dist] if dist in from_source else release[dist] for dist in FIELDS}
