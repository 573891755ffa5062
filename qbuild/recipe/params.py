"""The typed params of every build step: one frozen dataclass per step, the only definition of what a step takes.

The planner builds these objects; a plan node holds one, its canonical JSON (`to_json`) is the "params" of the node's
key preimage, and the step that builds the node receives the same object. `parse` reads the JSON back (a locked
preimage, a record in a bundle) with the same definitions: it refuses a missing or unknown field and a value outside
its Literal.

Steps defined here: fetch (hub or path), convert, shard, package, reference, verify. A backend defines its own
compile params (and the neuron backend its port params and its package params) in qbuild.backends.<backend>.params,
with the machinery below.
"""

from __future__ import annotations

import types
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from functools import cache
from typing import Literal, Union, get_args, get_origin, get_type_hints

from qbuild.core.dtypes import DType
from qbuild.model.arch import Arch, VisionArch
from qbuild.model.families import FamilyName
from qbuild.model.fp8 import FP8PolicyName
from qbuild.model.chunking import LongContext
from qbuild.model.ranks import RankLayout


class ParamsError(ValueError):
    """Step params that do not match their type: one line naming the field."""


@dataclass(frozen=True)
class FetchHub:
    """A Hub checkpoint at one commit: the recipe's own, the lock's pin, or what the Hub resolves when locking."""

    source: Literal["hf"]
    repo: str
    revision: str


@dataclass(frozen=True)
class FetchPath:
    """A local checkpoint directory, identified by its files' digests, never its path."""

    source: Literal["path"]
    files: dict[str, str]            # file name -> "blake3:<hex>"


FetchParams = Union[FetchHub, FetchPath]


@dataclass(frozen=True)
class ConvertParams:
    family: FamilyName
    dtype: DType
    fp8: FP8PolicyName


@dataclass(frozen=True)
class ShardParams:
    """How converted text weights are split into one file per rank (qbuild.model.convert.shard.shard_checkpoint)."""

    layout: str                      # whose rules: "cpu" (qbuild's reference model) or a backend's own layout, found
                                     # by name (qbuild.backends.shard_layout)
    ranks: RankLayout                # the world and how each kind of layer is split over it
    fused_qkv: bool
    dtype: DType


@dataclass(frozen=True)
class PackageParams:
    """A bundle: its shards and the compiled graphs of every bucket."""

    family: str
    backend: str
    tp: int
    ep: int
    ranks: int
    batch_size: int
    seq_len: int
    cte_buckets: tuple[int, ...]
    tkg_buckets: tuple[int, ...]
    vision_buckets: tuple[int, ...]
    dtype: DType
    # Chunked prefill and the prefix cache, where the bundle serves them (keyword-only: backends extend these params).
    long_context: LongContext | None = field(default=None, kw_only=True)

    def bundle_meta(self) -> dict:
        """What bundle.json records of these params."""
        meta = {"family": self.family, "backend": self.backend, "tp": self.tp, "ep": self.ep,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "dtype": self.dtype,
                "buckets": {"cte": list(self.cte_buckets), "tkg": list(self.tkg_buckets),
                            "vision": list(self.vision_buckets)}}
        if self.long_context is not None:
            meta["long_context"] = self.long_context.to_json()
        return meta


@dataclass(frozen=True)
class ReferenceParams:
    prompts: tuple[str, ...] | None  # None: the shipped golden prompts
    new_tokens: int
    image: bool                      # also a prompt with the synthetic image


@dataclass(frozen=True)
class VerifyParams:
    top1_min: float
    token_match_min: float
    max_logit_err: float


def parse(cls, value, where: str = "params"):
    """The `cls` (a params dataclass, or a Union of them told apart by a Literal field) that `value`, its JSON, holds;
    raises ParamsError naming the first field that does not fit."""
    return _value(cls, value, where)


def to_json(params) -> dict:
    """The canonical JSON of typed params (tuples written as lists); a plain dict is returned as JSON unchanged."""
    if isinstance(params, dict):
        return _to_json(params)
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
    try:
        return cls(**{n: _value(hints[n], value[n], f"{where}.{n}") for n in names})
    except ParamsError:
        raise
    except ValueError as e:     # fields each of its type, but not together (a RankLayout's degrees)
        raise ParamsError(f"{where}: {e}") from None


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
    if origin in (Union, types.UnionType):
        return _union(args, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ParamsError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _require_object(value, where)
        return {_value(args[0], k, where): _value(args[1], v, f"{where}.{k}") for k, v in value.items()}
    return _scalar(tp, value, where)


def _union(args: tuple, value, where: str):
    """X | None, or a union of params dataclasses: the one whose Literal fields (its tags: source, graph, backend)
    hold the most of the value's, then the one that names the most of its fields, so that a value none fits is refused
    naming the field that does not."""
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:
        return _value(options[0], value, where)
    _require_object(value, where)

    def fit(cls) -> tuple[int, int]:
        hints = _hints(cls)
        tags = sum(_tag_matches(hint, value.get(name)) for name, hint in hints.items() if get_origin(hint) is Literal)
        return tags, len(set(hints) & set(value))

    return _parse(max(options, key=fit), value, where)


def _tag_matches(hint, value) -> bool:
    return value in get_args(hint)


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

