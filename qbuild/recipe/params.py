"""The typed params of the compile, package and verify steps, read once from the JSON the planner writes.

The planner writes a node's params as a JSON-able dict, and that dict enters the node's content key, so its shape is
fixed. An action parses it here at its entry, and everything below the action (the backends) takes the typed object.
Parsing refuses a missing or unknown field and a value outside its Literal; `to_json` writes the same dict back (a
neuron compile's record and its work-dir name are made from it).

Compile params are a tagged union on (backend, graph):
    CpuTextCompile      export / inductor, graph cte | tkg: one text graph at one bucket
    CpuVisionCompile    export / inductor, graph vision: the vision encoder at one patch bucket
    NeuronTextCompile   neuron, graph text: NxDI's one compile of every CTE and TKG bucket
    NeuronVisionCompile neuron, graph vision: the port's traced vision encoder at one patch bucket
"""

from __future__ import annotations

import types
from dataclasses import asdict, dataclass, fields, is_dataclass
from functools import cache
from typing import Literal, Union, get_args, get_origin, get_type_hints

from qbuild.model.arch import Arch, VisionArch
from qbuild.backends import CpuBackend, Target
from qbuild.core.dtypes import DType
from qbuild.model.families import FP8Policy, LineageName, MoEBackend

TextGraph = Literal["cte", "tkg"]


class ParamsError(ValueError):
    """Step params that do not match their type: one line naming the field."""


@dataclass(frozen=True)
class CpuTextCompile:
    graph: TextGraph
    bucket: int
    backend: CpuBackend
    dtype: DType
    text: Arch                       # the text model's fingerprint (no vision encoder)
    tp: int
    ep: int
    moe_tp: int | None               # None for a dense model
    batch_size: int
    seq_len: int
    fp8: FP8Policy
    moe_backend: MoEBackend | None   # None for a dense model
    fused_qkv: bool


@dataclass(frozen=True)
class CpuVisionCompile:
    graph: Literal["vision"]
    bucket: int
    backend: CpuBackend
    dtype: DType
    vision: VisionArch


@dataclass(frozen=True)
class NxdParallel:
    """NxDI's parallel degrees (qbuild.backends.neuron.nxd_parallel); world_size is the number of ranks."""

    tp_degree: int
    ep_degree: int
    moe_tp_degree: int | None        # None for a dense model
    moe_ep_degree: int | None
    world_size: int


@dataclass(frozen=True)
class CompilerSettings:
    target: Target
    lnc: int                         # logical NeuronCore config (the recipe's, or the target's default)
    flags: tuple[str, ...]           # appended after the port's own compiler arguments


@dataclass(frozen=True)
class NeuronTextCompile:
    graph: Literal["text"]
    backend: Literal["neuron"]
    lineage: LineageName
    text: Arch
    parallel: NxdParallel
    dtype: DType
    fp8: FP8Policy
    moe_backend: MoEBackend | None
    fused_qkv: bool
    batch_size: int
    seq_len: int
    cte_buckets: tuple[int, ...]
    tkg_buckets: tuple[int, ...]
    compiler: CompilerSettings
    toolchain: dict[str, str]        # distribution -> the recipe's pinned version
    port_env: dict[str, str]         # the only port switches a compile sees
    pad_token_id: int | None
    vision_inputs: bool              # the context-encoding graph takes vision embeddings (the recipe has vision)


@dataclass(frozen=True)
class NeuronVisionCompile:
    graph: Literal["vision"]
    bucket: int
    backend: Literal["neuron"]
    lineage: LineageName
    vision: VisionArch
    dtype: DType
    compiler: CompilerSettings
    toolchain: dict[str, str]
    port_env: dict[str, str]


CompileParams = Union[CpuTextCompile, CpuVisionCompile, NeuronTextCompile, NeuronVisionCompile]
NeuronCompile = Union[NeuronTextCompile, NeuronVisionCompile]


@dataclass(frozen=True)
class PackageParams:
    """A CPU bundle: its shards and one compiled graph per bucket."""

    family: str
    backend: CpuBackend
    tp: int
    ep: int
    ranks: int
    batch_size: int
    seq_len: int
    cte_buckets: tuple[int, ...]
    tkg_buckets: tuple[int, ...]
    vision_buckets: tuple[int, ...]
    dtype: DType


@dataclass(frozen=True)
class NeuronPackageParams(PackageParams):
    """A neuron bundle: NxDI's compiled directory, loaded by the lineage's port."""

    backend: Literal["neuron"]
    lineage: LineageName
    fp8: FP8Policy


@dataclass(frozen=True)
class VerifyParams:
    top1_min: float
    token_match_min: float
    max_logit_err: float


def parse_compile(params: dict) -> CompileParams:
    """The typed params of a compile node; raises ParamsError naming the first field that does not fit."""
    _require_object(params, "compile params")
    if params.get("backend") == "neuron":
        cls = NeuronVisionCompile if params.get("graph") == "vision" else NeuronTextCompile
    else:
        cls = CpuVisionCompile if params.get("graph") == "vision" else CpuTextCompile
    return _parse(cls, params, "compile params")


def parse_package(params: dict) -> PackageParams:
    _require_object(params, "package params")
    cls = NeuronPackageParams if params.get("backend") == "neuron" else PackageParams
    return _parse(cls, params, "package params")


def parse_verify(params: dict) -> VerifyParams:
    return _parse(VerifyParams, params, "verify params")


def to_json(params) -> dict:
    """The params dict a typed object was parsed from (tuples written as lists)."""
    return {f.name: _to_json(getattr(params, f.name)) for f in fields(params)}


# --- parsing by the dataclasses' own field types -------------------------------------------------------------------

def _require_object(value, where: str) -> None:
    if not isinstance(value, dict):
        raise ParamsError(f"{where}: expected an object, got {type(value).__name__}")


@cache
def _hints(cls) -> dict:
    return get_type_hints(cls)


def _check_names(value: dict, names: list[str], where: str) -> None:
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ParamsError(f"{where}.{unknown[0]}: unknown field")
    missing = [n for n in names if n not in value]
    if missing:
        raise ParamsError(f"{where}.{missing[0]}: missing")


def _parse(cls, value, where: str):
    _require_object(value, where)
    names = [f.name for f in fields(cls)]
    _check_names(value, names, where)
    hints = _hints(cls)
    return cls(**{n: _value(hints[n], value[n], f"{where}.{n}") for n in names})


def _arch(cls, value, where: str):
    """An Arch or VisionArch from its fingerprint, which must name every graph-shaping field and nothing else."""
    _require_object(value, where)
    names = [f.name for f in fields(cls)]
    if cls is Arch:   # compile params hold the text model alone; host-side fields never enter a key
        names = [n for n in names if n not in Arch.HOST_FIELDS and n != "vision"]
    _check_names(value, names, where)
    return cls.from_fingerprint(value)


def _value(tp, value, where: str):
    if tp in (Arch, VisionArch):
        return _arch(tp, value, where)
    if is_dataclass(tp):
        return _parse(tp, value, where)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ParamsError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (Union, types.UnionType):   # X | None
        if value is None and type(None) in args:
            return None
        return _value(next(a for a in args if a is not type(None)), value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ParamsError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _require_object(value, where)
        return {_value(args[0], k, where): _value(args[1], v, f"{where}.{k}") for k, v in value.items()}
    return _scalar(tp, value, where)


def _scalar(tp, value, where: str):
    # bool is an int in Python: a `true` where a count belongs (or 1 where a flag belongs) is refused.
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}.get(tp)
    assert ok is not None, f"{where}: no parser for fields of type {tp!r}"
    if not ok:
        raise ParamsError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _to_json(value):
    if isinstance(value, Arch):
        fp = value.fingerprint()
        del fp["vision"]
        return _to_json(fp)
    if isinstance(value, VisionArch):
        return asdict(value)
    if is_dataclass(value):
        return to_json(value)
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value

