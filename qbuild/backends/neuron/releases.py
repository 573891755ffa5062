"""The Neuron SDK releases a neuron recipe may pin, each with the exact versions of the four Python distributions a
compile runs (docs/neuron-sdk.md, read from the SDK's own package manifest: aws-neuron/aws-neuron-sdk
src/helperscripts/n2-manifest.json @ a3247f5b8c30, the 2.32.0 release commit, which lists every release since 2.18;
2.29.0's entry is the same in that release's own commit, 539a73c5). A recipe names a release (`toolchain: {sdk:
"2.30.0"}`) or the four versions; a set mixed from several releases is refused naming the release each version belongs
to, since no standard host has it. Each release also names the vLLM stack that serves NxDI models on it (SERVING,
docs/vllm.md section 1): a bundle records its release's stack, and `qbuild serve` refuses a host with another.

Pure data: nothing here imports the SDK.
"""

from __future__ import annotations

from dataclasses import dataclass

# distribution -> the recipe's toolchain field that pins it
FIELDS = {"neuronx-cc": "neuronx_cc", "neuronx-distributed": "neuronx_distributed",
          "neuronx-distributed-inference": "neuronx_distributed_inference", "torch-neuronx": "torch_neuronx"}


def _release(cc: str, nxd: str, nxdi: str, torch_neuronx: str) -> dict[str, str]:
    return {"neuronx-cc": cc, "neuronx-distributed": nxd, "neuronx-distributed-inference": nxdi,
            "torch-neuronx": torch_neuronx}


# The releases of the NxDI era whose torch-neuronx is built on torch 2.8 or 2.9 (what the Qwen3.5 ports import), each
# with the build a recipe that names only the release gets.
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
# Builds a release ships beside the one above: 2.27 and 2.28 list torch-neuronx for torch 2.7, 2.8 and 2.9
# (n2-manifest.json @ a3247f5b8c30, entries 2.27.0-2.28.1). A recipe may pin any of them.
OTHER_BUILDS: dict[str, dict[str, tuple[str, ...]]] = {
    "2.27.0": {"torch-neuronx": ("2.7.0.2.11.19912", "2.9.0.2.11.19912")},
    "2.27.1": {"torch-neuronx": ("2.7.0.2.11.19912", "2.9.0.2.11.19912")},
    "2.28.0": {"torch-neuronx": ("2.7.0.2.12.22436", "2.9.0.2.12.22436")},
    "2.28.1": {"torch-neuronx": ("2.7.0.2.12.22436", "2.9.0.2.12.22436")},
}


# Releases whose manifest has no NxDI: a recipe cannot build with them, and resolve says why.
WITHOUT_NXDI: dict[str, str] = {
    # n2-manifest.json L107-133 @ a3247f5b8c30 lists neuronx-cc 2.27.5334.0 and the NxDI-free vllm-neuron
    # 0.24.0.1.1.0 (L131), no NxD, NxDI or torch-neuronx; NxDI is in maintenance mode from 2.32.0
    # (release-notes/components/nxd-inference.rst L15-23) and its DLCs are gone (components/containers.rst L31).
    "2.32.0": "its package manifest lists neuronx-cc and the NxDI-free vllm-neuron 0.24.0.1.1.0 only (NxDI is in "
              "maintenance mode from 2.32.0); name 2.31.0 or earlier",
}


@dataclass(frozen=True)
class ServingStack:
    """The vLLM and vllm-neuron (NxDI plugin) versions that serve NxDI models on a release. A version is matched as a
    prefix of whole components: "0.4" is every 0.4.x, "0.5.0" and "0.16.0" those releases (with any local suffix)."""

    vllm: str
    vllm_neuron: str


# Each release's NxDI serving stack, from that release's own docs (aws-neuron-sdk at its release commit):
# - 2.27: plugin 0.2.2+lts, vLLM 0.11.0 (libraries/nxd-inference/developer_guides/vllm-user-guide-v1.rst L23-29
#   @ fd80ca78, the 2.27.1 docs).
# - 2.28: vLLM 0.13.0 (release-notes/prev/content.rst L387, L464 @ a3247f5b8c30) with plugin 0.4.x: 0.4.0 at release,
#   0.4.1 after (release-notes/components/nxd-inference.rst L79, L113-127 @ a3247f5b8c30).
# - 2.29.0: plugin 0.5.0 on vLLM 0.16.0 (vllm-user-guide-v1.rst L24, L28, L80, L84 `git clone --branch "0.5.0"`
#   @ 539a73c5, the 2.29.0 release; "NxD Inference [0.9.17334] + vLLM Neuron Plugin [0.5.0] (Neuron 2.29.0 Release)":
#   nxd-inference.rst L41 @ a3247f5b8c30).
# - 2.29.1, 2.30.0, 2.31.0: the same guide, unchanged, still clones 0.5.0 (L24, L84 @ 6616e998, @ 3afa0fdf and
#   @ ee7d6e00); none of their release notes names another plugin.
# - 2.31.1: libraries/vllm-neuron/neuron-inference-overview.rst, new in that release, "Supports vLLM 0.16 via plugin
#   version 0.5.x" and clones 0.5.3 (L46-47, L54 @ c19b2e69); the vLLM guide of the same commit still says 0.5.0
#   (vllm-user-guide-v1.rst L26, L86), so the newer page is taken. The manifest's `vllm-neuron 0.21.0.1.0.0` for
#   2.31.1 (n2-manifest.json L163 @ a3247f5b8c30) is the NxDI-free "vLLM Neuron" beta (overview L75-83): no NxDI
#   loader, it cannot serve a bundle.
# vLLM is 0.16.0 for 2.29.0-2.31.1 (release-notes/prev/content.rst L65, L146, L227, L308 @ a3247f5b8c30;
# releasecontent.rst L57 @ 539a73c5).
_VLLM_011 = ServingStack(vllm="0.11.0", vllm_neuron="0.2.2")
_VLLM_013 = ServingStack(vllm="0.13.0", vllm_neuron="0.4")
_PLUGIN_050 = ServingStack(vllm="0.16.0", vllm_neuron="0.5.0")
SERVING: dict[str, ServingStack] = {
    "2.27.0": _VLLM_011, "2.27.1": _VLLM_011, "2.28.0": _VLLM_013, "2.28.1": _VLLM_013,
    "2.29.0": _PLUGIN_050, "2.29.1": _PLUGIN_050, "2.30.0": _PLUGIN_050, "2.31.0": _PLUGIN_050,
    "2.31.1": ServingStack(vllm="0.16.0", vllm_neuron="0.5.3"),
}
# The stack whose source qbuild's serving glue was read against (docs/vllm.md): vllm-neuron 0.5.0 (@ 3afb0a9) on vLLM
# 0.16.0. 0.5.1-0.5.3 are in no readable snapshot, and the Qwen3.6-27B port's vLLM patch is written against 0.5.0
# (its vllm/README.md L14-20 @ 03db3ef), so a bundle of a release served by another plugin is refused.
GLUE_STACK = _PLUGIN_050


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


def builds(release: str, dist: str) -> tuple[str, ...]:
    """Every version of `dist` that `release` ships, the default build first."""
    return (RELEASES[release][dist], *OTHER_BUILDS.get(release, {}).get(dist, ()))


def releases_of(dist: str, version: str) -> list[str]:
    """The releases that ship `version` of `dist`, oldest first."""
    return [name for name in RELEASES if any(same_version(version, b) for b in builds(name, dist))]


def _spelled(release: str, dist: str, pin: str | None) -> str:
    """The release's own spelling of the build `pin` names (the default build where there is no pin)."""
    return next((b for b in builds(release, dist) if pin is not None and same_version(b, pin)), RELEASES[release][dist])


def serving_stack(toolchain: dict[str, str], sdk: str | None = None) -> tuple[list[str], ServingStack]:
    """(the releases a bundle serves as, their vLLM stack): the release a recipe names (`sdk`), or else the releases
    that ship `toolchain`'s versions. A version no release ships (a distribution installed from a source tree, like
    the 27B recipe's NxDI) says nothing of the release. Where those releases serve with different stacks (2.31.0 and
    2.31.1 ship the same four versions), the oldest is taken, as `resolve` spells the versions as the oldest release's.
    ValueError where no release ships them."""
    if sdk is not None:
        return [sdk], SERVING[sdk]
    candidates = releases_for(toolchain)
    if not candidates:
        raise ValueError("no Neuron SDK release ships these versions")
    if len({SERVING[name] for name in candidates}) > 1:
        candidates = candidates[:1]
    return candidates, SERVING[candidates[0]]


def releases_for(toolchain: dict[str, str]) -> list[str]:
    """The releases that ship every version of `toolchain` that some release ships, oldest first."""
    known = [dist for dist in FIELDS if releases_of(dist, toolchain[dist])]
    return [name for name in RELEASES
            if all(any(same_version(toolchain[dist], b) for b in builds(name, dist)) for dist in known)]


def at_least(release: str, version: str) -> bool:
    """Whether `release` is `version` or later ("2.31.0" is at least "2.29")."""
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))
    return parts(release) >= parts(version)


def stack_matches(installed: str, spec: str) -> bool:
    """Whether an installed version is the one a stack names: `spec`'s components are a prefix of the public
    version's ("0.5" takes 0.5.3; "0.16.0" takes 0.16.0+neuron, not 0.16.1)."""
    public = installed.split("+", 1)[0].split(".")
    want = spec.split(".")
    return public[:len(want)] == want


def resolve(sdk: str | None, pins: dict[str, str | None], from_source: tuple[str, ...] = ()) -> dict[str, str]:
    """The exact four versions a recipe's toolchain names; ToolchainError where it names no release, or versions of
    several. `from_source` names distributions installed from a source tree rather than a
    release (their pin is taken as written, and belongs to no release)."""
    if sdk is not None:
        if sdk in WITHOUT_NXDI:
            raise ToolchainError("sdk", f"{sdk!r}: {WITHOUT_NXDI[sdk]}")
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
            elif pin is None or any(same_version(b, pin) for b in builds(sdk, dist)):
                out[dist] = _spelled(sdk, dist, pin)
            else:
                where = releases_of(dist, pin)
                raise ToolchainError(field, f"{pin} is not SDK {sdk}'s ({' or '.join(builds(sdk, dist))})"
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
    release = min(candidates, key=list(RELEASES).index)
    return {dist: pins[dist] if dist in from_source else _spelled(release, dist, pins[dist]) for dist in FIELDS}
