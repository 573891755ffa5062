"""Recipes: YAML files that declare what to build, validated by pydantic with errors at file:line:column."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, FiniteFloat, StrictBool,
                      StrictInt, Tag, ValidationError, ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from qbuild.core.dtypes import DType
from qbuild.core.errors import RecipeError
from qbuild.core.hashing import is_commit
from qbuild.core.urls import carries_credentials, without_credentials
from qbuild.model.families import MoEBackend
from qbuild.model.fp8 import FP8PolicyName
from qbuild.core.userfile import read_small_file


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, got true/false")
    return value


Target = Literal["trn2", "trn1", "inf2"]                 # the Neuron device a compile targets
LineageName = Literal["main", "main-replicated", "moe"]  # the NxDI contrib port lineages (qbuild.backends)


# Integers and booleans are strict: `tp: true`, `tp: 1.0`, `seq_len: "512"` or `fused_qkv: 1` are errors, never
# coerced. Numbers take ints and numeric strings (PyYAML reads `1e-3`, without a dot, as a string), but neither
# booleans nor NaN or infinity (a threshold of .nan or .inf would make its check meaningless).
Number = Annotated[FiniteFloat, BeforeValidator(_not_a_bool)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HFSource(_Strict):
    """A Hugging Face hub repo, pinned by `revision`."""

    hf: str = Field(..., pattern=r"^[\w.-]+/[\w.-]+$", description="Hugging Face repo id, org/name")
    revision: str = Field("main", description="branch, tag or commit sha; resolved to a commit and locked")


class PathSource(_Strict):
    """A local checkpoint directory."""

    path: str = Field(..., description="local checkpoint directory, relative to the recipe file")


# The union's tags, as pydantic puts them in error locations (load_recipe leaves them out of the field it names).
_SOURCE_TAGS = {HFSource: "hf source", PathSource: "path source"}


def _set_source_fields(value: Any) -> Any:
    """A `model:` mapping with null `hf` / `path` dropped, so that a recipe can switch the source its base names
    (`hf: null, path: ...`), and with a base's `revision` dropped where the source is a path (it pins nothing)."""
    if isinstance(value, (HFSource, PathSource)):
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("dict_type", "Input should be a valid dictionary or instance of ModelSource")
    value = {k: v for k, v in value.items() if not (k in ("hf", "path") and v is None)}
    if "path" in value and "hf" not in value:
        value.pop("revision", None)
    return value


def _source_tag(value: Any) -> str | None:
    if isinstance(value, (HFSource, PathSource)):
        return _SOURCE_TAGS[type(value)]
    named = [cls for cls, key in ((HFSource, "hf"), (PathSource, "path")) if key in value]
    return _SOURCE_TAGS[named[0]] if len(named) == 1 else None


ModelSource = Annotated[
    Annotated[HFSource, Tag(_SOURCE_TAGS[HFSource])] | Annotated[PathSource, Tag(_SOURCE_TAGS[PathSource])],
    Discriminator(_source_tag, custom_error_type="model_source",
                  custom_error_message="give exactly one of `hf` or `path`"),
    BeforeValidator(_set_source_fields)]


class Parallelism(_Strict):
    """How the recipe's model is split over ranks: `tp` splits every layer, `ep` groups the experts. The files and
    ranks each backend derives from them are its RankLayout (qbuild.model.ranks), on the shard step's params."""

    tp: StrictInt = Field(1, ge=1, le=64, description="tensor-parallel degree: the ranks every layer is split over")
    ep: StrictInt = Field(1, ge=1, le=64, description="expert-parallel degree (MoE families): the groups the experts "
                                                      "are split into; it divides tp on the CPU backends")

    @model_validator(mode="after")
    def _consistent(self) -> "Parallelism":
        if self.tp % self.ep:
            raise ValueError(f"ep={self.ep} must divide tp={self.tp}")
        return self

    @property
    def moe_tp(self) -> int:
        """The ranks of one expert group, over which each expert's intermediate is split (tp // ep)."""
        return self.tp // self.ep


def _check_buckets(v: list[int]) -> list[int]:
    if not v:
        raise ValueError("at least one bucket is needed")
    if any(b <= 0 for b in v):
        raise ValueError("buckets must be positive")
    if len(set(v)) != len(v):
        raise ValueError(f"buckets must be unique: {v}")
    if v != sorted(v):
        raise ValueError(f"buckets must be sorted ascending: {v}")
    return v


class ChunkedPrefill(_Strict):
    """Prompts longer than the largest context-encoding bucket are prefilled chunk by chunk, each chunk through the
    compiled bucket of `chunk_size` with the attention KV and DeltaNet state of the tokens before it; the sequence
    length, not the bucket, then bounds a prompt (as vLLM's chunked prefill and the Qwen3.6-27B port do)."""

    chunk_size: StrictInt | None = Field(None, ge=1, description="tokens per prefill chunk, one of cte_buckets (vLLM's "
                                                                 "--max-num-batched-tokens); default the largest")


class PrefixCache(_Strict):
    """Automatic prefix caching for a hybrid model (vLLM's, as the Qwen3.6-27B port's hybrid APC does it): attention KV
    kept per block of `block_size` tokens, keyed by a hash chain over the blocks, and DeltaNet (recurrent + conv)
    state checkpoints every `checkpoint_interval` tokens; a prompt that shares a cached prefix resumes at the deepest
    checkpoint of it. Needs chunked_prefill."""

    block_size: StrictInt = Field(256, ge=1, description="tokens per KV block (vLLM --block-size, NxDI pa_block_size)")
    num_blocks: StrictInt | None = Field(None, ge=1, description="KV blocks kept (vLLM --num-gpu-blocks-override, NxDI "
                                                                 "pa_num_blocks); default ceil(seq_len / block_size) "
                                                                 "* batch_size")
    checkpoint_interval: StrictInt | None = Field(None, ge=1, description="tokens between DeltaNet state checkpoints, "
                                                                          "a multiple of block_size (the port's "
                                                                          "gdn_checkpoint_interval); default "
                                                                          "block_size")
    checkpoint_slots: StrictInt = Field(8, ge=1, description="DeltaNet state checkpoints kept (the port's "
                                                             "max_gdn_checkpoint_slots)")
    # The CPU backends cache prefixes whatever this says (their cache is exact: docs/long-context.md section 2). A
    # neuron bundle is compiled with the port's hybrid APC manager either way; this only decides whether vLLM serves it
    # with prefix caching, which the port itself calls not fully implemented (docs/long-context.md section 5).
    neuron_apc: Literal["off", "experimental"] = Field(
        "off", description="serve a neuron bundle with vLLM's prefix caching through the Qwen3.6-27B port's hybrid "
                           "DeltaNet APC, which its authors call an experiment: off (default) or experimental")


class Sampling(_Strict):
    """How a neuron build picks each generated token. on_device: inside the compiled graphs, as the Qwen3.5 ports compile
    it (NxDI's OnDeviceSamplingConfig(top_k=1): an argmax over the vocabulary, so each step returns its token and no
    logits; docs/models.md section 3); off: the graphs return the logits and the host picks. The CPU backends compute
    logits either way and pick the same greedy tokens."""

    on_device: StrictBool = Field(False, description="sample inside the compiled graphs (neuron)")
    top_k: Literal[1] = Field(1, description="NxDI's OnDeviceSamplingConfig.top_k; 1 only: greedy decoding, which "
                                             "qbuild verifies and serves")


class Text(_Strict):
    batch_size: StrictInt = Field(1, ge=1, le=256)
    seq_len: StrictInt = Field(..., ge=1, description="maximum context (prompt + generated tokens)")
    cte_buckets: list[StrictInt] = Field(..., description="context-encoding (prefill) bucket lengths")
    tkg_buckets: list[StrictInt] | None = Field(None, description="token-generation buckets (KV length); default "
                                                                  "[seq_len]")

    # Field validators (not a model validator) so that an error names the list it is about, at its line. Fields
    # validate in declaration order: `info.data` holds seq_len and cte_buckets where they were valid.
    @field_validator("cte_buckets", "tkg_buckets")
    @classmethod
    def _buckets(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is None:
            return v
        _check_buckets(v)
        seq_len = info.data.get("seq_len")
        over = [b for b in v if seq_len is not None and b > seq_len]
        if over:
            raise ValueError(f"{over} exceed seq_len {seq_len}")
        cte = info.data.get("cte_buckets")
        if info.field_name == "tkg_buckets" and cte and v[-1] < cte[-1]:
            # The runtime and NxDI decode a prompt of up to the largest context bucket in the token-generation
            # buckets; a KV length below it leaves every longer prompt nowhere to decode.
            raise ValueError(f"the largest token-generation bucket {v[-1]} is smaller than the largest "
                             f"context-encoding bucket {cte[-1]}: a prompt that fills it could not generate; make "
                             f"the last tkg bucket at least {cte[-1]} (or drop tkg_buckets: the default is [seq_len])")
        return v

    chunked_prefill: ChunkedPrefill | None = Field(None, description="prefill long prompts chunk by chunk; absent: "
                                                                      "a prompt must fit the largest cte bucket")
    prefix_cache: PrefixCache | None = Field(None, description="reuse the KV and DeltaNet state of cached prompt "
                                                               "prefixes; needs chunked_prefill")
    sampling: Sampling = Field(Sampling(), description="how a neuron build picks each token: on the device "
                                                       "(the ports' OnDeviceSamplingConfig(top_k=1)) or on the host")

    @property
    def token_buckets(self) -> list[int]:
        return self.tkg_buckets or [self.seq_len]

    @property
    def chunk_size(self) -> int | None:
        """The prefill chunk (None: no chunked prefill)."""
        if self.chunked_prefill is None:
            return None
        return self.chunked_prefill.chunk_size or self.cte_buckets[-1]

    @property
    def num_blocks(self) -> int | None:
        """The prefix cache's KV blocks (None: no prefix cache)."""
        cache = self.prefix_cache
        if cache is None:
            return None
        return cache.num_blocks or -(-self.seq_len // cache.block_size) * self.batch_size

    @property
    def checkpoint_interval(self) -> int | None:
        cache = self.prefix_cache
        return None if cache is None else cache.checkpoint_interval or cache.block_size


class Vision(_Strict):
    buckets: list[StrictInt] = Field(..., description="patch-token counts before the 2x2 merge, e.g. 1024, 4096; an "
                                                      "image larger than the largest runs as 2x2 tiles through it")
    tp: StrictInt = Field(1, ge=1, description="tensor-parallel degree of the vision encoder: neuron traces it over tp "
                                               "NeuronCores with NxD's parallel_model_trace (docs/vision.md); the CPU "
                                               "backends compute it with the same sharding")

    _buckets = field_validator("buckets")(_check_buckets)


class Compiler(_Strict):
    target: Target = "trn2"
    lnc: StrictInt | None = Field(None, ge=1, le=2,
                                  description="logical NeuronCore config; default 2 on trn2, else 1")
    flags: list[str] = Field(default_factory=list, description="extra neuronx-cc flags")

    @property
    def effective_lnc(self) -> int:
        return self.lnc if self.lnc is not None else (2 if self.target == "trn2" else 1)


# A git URL a port is fetched from: https, ssh, git or file URLs, or scp-like `user@host:path`. Never a leading "-",
# which git would read as an option, nor a transport such as `ext::`, which runs a command.
_GIT_URL = re.compile(r"^(?:(?:https?|ssh|git|file)://[^\s]+|[\w.-]+@[\w.-]+:[^\s]+)$")


class Port(_Strict):
    """The NxDI contrib port a neuron build runs (qbuild.backends.neuron.ports): its lineage and where its source
    lives: a pinned commit of a git repository (`git`, `rev`, `subdir`), or, while working on a port, a local
    directory (`path`) or importable package (`module`)."""

    lineage: LineageName | None = Field(None, description="main | main-replicated | moe; default per family "
                                                          "(Coder-Next: moe)")
    git: str | None = Field(None, description="the git repository holding the port, e.g. "
                                              "https://github.com/aws-neuron/neuronx-distributed-inference.git")
    rev: str | None = Field(None, description="the full 40-hex commit of `git` to build (never a branch or tag)")
    subdir: str | None = Field(None, description="the port's directory in that commit, e.g. "
                                                 "contrib/models/Qwen3.5-2B")
    path: str | None = Field(None, description="the port directory (holds src/), relative to the recipe file")
    module: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*$",
                               description="an importable package whose directory is the port directory")
    env: dict[str, str] = Field(default_factory=dict,
                                description="the port's own switches (e.g. QWEN36_DELTANET_CTE_IMPL), read while "
                                            "tracing; part of the compile key")

    @field_validator("git")
    @classmethod
    def _git_url(cls, v: str | None) -> str | None:
        # Refused, never scrubbed: the URL is in the port's key, the lockfile, `plan --json` and the store's git config,
        # and a token there would be in all of them (docs/architecture.md, "Credentials").
        if v is not None and carries_credentials(v):
            raise ValueError("the URL carries credentials (user:password@ or a token); remove them: git takes them "
                             "from its credential helper (git config credential.helper) or GIT_ASKPASS")
        if v is not None and not _GIT_URL.match(v):
            raise ValueError(f"{without_credentials(v)!r} is not a git URL (https://, ssh://, git://, file:// or "
                             "user@host:path)")
        return v

    @field_validator("rev")
    @classmethod
    def _full_commit(cls, v: str | None) -> str | None:
        if v is not None and not is_commit(v):
            raise ValueError(f"{v!r} is not a full commit: give the 40-hex sha (a branch, tag or short sha can name "
                             "another commit tomorrow)")
        return v

    @field_validator("subdir")
    @classmethod
    def _inside_the_repository(cls, v: str | None) -> str | None:
        if v is not None:
            parts = v.strip("/").split("/")
            if v.startswith("/") or not v.strip("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"{v!r} is not a directory of the repository: give a relative path such as "
                                 "contrib/models/Qwen3.5-2B")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "Port":
        given = [name for name in ("git", "path", "module") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give only one of `git`, `path` or `module` (got {' and '.join(given)})")
        if self.git is not None and (self.rev is None or self.subdir is None):
            missing = " and ".join(f"`{f}`" for f in ("rev", "subdir") if getattr(self, f) is None)
            raise ValueError(f"a git port needs {missing}: the full commit and the port's directory in it")
        if self.git is None and (self.rev is not None or self.subdir is not None):
            raise ValueError("`rev` and `subdir` pin a git port: give `git` too, or drop them")
        return self


class Toolchain(_Strict):
    """The Neuron SDK a neuron build is keyed on and must run with (pinned, never probed): a release, or the exact
    versions of its four distributions (qbuild.backends.neuron.releases checks they are one release's)."""

    sdk: str | None = Field(None, pattern=r"^\d+\.\d+\.\d+$", description="a Neuron SDK release, e.g. 2.31.0")
    neuronx_cc: str | None = Field(None, description="neuronx-cc version, e.g. 2.26.6360.0")
    neuronx_distributed: str | None = Field(None, description="neuronx-distributed (NxD) version")
    neuronx_distributed_inference: str | None = Field(None, description="neuronx-distributed-inference version")
    torch_neuronx: str | None = Field(None, description="torch-neuronx version")
    from_source: list[Literal["neuronx_cc", "neuronx_distributed", "neuronx_distributed_inference",
                              "torch_neuronx"]] = Field(
        default_factory=list, description="distributions installed from a source tree, not from the release "
                                          "(their version is pinned as that tree reports it)")

    def pins(self) -> dict[str, str | None]:
        """{distribution name: pinned version}."""
        return {name.replace("_", "-"): getattr(self, name)
                for name in ("neuronx_cc", "neuronx_distributed", "neuronx_distributed_inference", "torch_neuronx")}


class Verify(_Strict):
    top1_min: Number = Field(0.95, ge=0, le=1, description="fraction of prefill positions whose argmax agrees")
    token_match_min: Number = Field(0.9, ge=0, le=1, description="fraction of greedy tokens equal to the reference")
    max_logit_err: Number = Field(0.05, ge=0, description="max |logit - reference| over prefill positions")
    new_tokens: StrictInt = Field(16, ge=1, le=1024, description="greedy tokens generated per prompt")
    prompts: list[str] | None = Field(None, description="golden prompts; default the shipped set")
    image_prompt: StrictBool = Field(True, description="VL recipes also check a prompt with a synthetic image")

    @field_validator("prompts")
    @classmethod
    def _prompts_have_text(cls, v: list[str] | None) -> list[str] | None:
        # An empty prompt tokenizes to no ids: the reference model cannot run it, nor the bundle prefill it.
        if v is not None and any(not p for p in v):
            raise ValueError(f"prompt {next(i for i, p in enumerate(v) if not p)} is empty")
        return v


class Recipe(_Strict):
    """One build configuration: a model, how it is split across ranks, the graphs to compile, and the checks."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: ModelSource
    parallel: Parallelism = Parallelism()
    text: Text
    vision: Vision | None = None
    dtype: DType = "bfloat16"
    fp8: FP8PolicyName = "none"
    moe_backend: MoEBackend | None = Field(None, description="MoE families only; default per family")
    fused_qkv: StrictBool = False
    compiler: Compiler = Compiler()
    # A name of qbuild.backends.NAMES, checked where the plan resolves it (the recipe layer sits below the backends).
    backend: str = Field("neuron", description="neuron, or a CPU backend (inductor, export) that proves every stage")
    port: Port = Port()
    toolchain: Toolchain = Toolchain()
    verify: Verify = Verify()


class LoadedRecipe(BaseModel):
    """A validated recipe with where it came from (for relative paths and error messages)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    recipe: Recipe
    path: Path

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def source_dir(self) -> Path | None:
        src = self.recipe.model
        return (self.path.parent / src.path).resolve() if isinstance(src, PathSource) else None

    def with_backend(self, backend: str | None) -> "LoadedRecipe":
        """This recipe built on another backend (`--backend`, e.g. a CPU proof of a neuron recipe). Its artifacts
        are another build's, so it is locked under its own name, `<name>@<backend>`."""
        if backend is None or backend == self.recipe.backend:
            return self
        recipe = self.recipe.model_copy(update={"backend": backend, "name": f"{self.recipe.name}@{backend}"})
        return LoadedRecipe(recipe=recipe, path=self.path)


# --- YAML with positions -------------------------------------------------------------------------------------

Marks = dict[tuple, tuple[Path, int, int]]


def _construct(node: yaml.Node, path: tuple, marks: Marks, file: Path) -> Any:
    marks[path] = (file, node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise RecipeError(f"{file}:{k.start_mark.line + 1}:{k.start_mark.column + 1}: a key must be a plain "
                                  "name, not a list or mapping")
            key = k.value
            if key in out:
                raise RecipeError(f"{file}:{k.start_mark.line + 1}:{k.start_mark.column + 1}: duplicate key {key!r}")
            marks[path + (key,)] = (file, k.start_mark.line + 1, k.start_mark.column + 1)
            out[key] = _construct(v, path + (key,), marks, file)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, path + (i,), marks, file) for i, v in enumerate(node.value)]
    loader = yaml.SafeLoader("")
    return loader.construct_object(node, deep=True)


# Recipes are a few KiB; the cap keeps `extends: /dev/zero`-like mistakes from reading without end.
MAX_RECIPE_BYTES = 1 << 20


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases: a handful of nested aliases expands to billions of nodes (a YAML bomb), and
    recipes share settings through `extends:` instead."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise RecipeError(f"{self.name}:{mark.line + 1}:{mark.column + 1}: YAML aliases (*name) are not "
                              "supported in recipes; share settings with `extends:`")
        return super().compose_node(parent, index)


def _compose(text: str, file: Path):
    """The document's node tree. libyaml, where PyYAML has it, parses several times faster than PyYAML's own parser
    (which was most of the time of planning an edited recipe); a document it finds an alias or an error in is parsed
    again by _NoAliasLoader, so that every error reads the same with libyaml or without."""
    c_loader = getattr(yaml, "CSafeLoader", None)
    if c_loader is not None:
        try:
            if not any(isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=c_loader)):
                return yaml.compose(text, Loader=c_loader)
        except yaml.YAMLError:
            pass
    loader = _NoAliasLoader(text)
    loader.name = str(file)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def _read_yaml(file: Path) -> tuple[dict, Marks]:
    raw = read_small_file(file, MAX_RECIPE_BYTES, "a recipe")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{file}: not UTF-8 text (byte {e.start} is {raw[e.start]:#04x})") from None
    try:
        node = _compose(text, file)
        marks: Marks = {}
        data = {} if node is None else _construct(node, (), marks, file)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        raise RecipeError(f"{where}: invalid YAML: {e.problem}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{file}: invalid YAML: {e}") from None
    except RecursionError:
        raise RecipeError(f"{file}: invalid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{file}:1:1: a recipe must be a mapping of fields")
    return data, marks


def _merge(base: dict, child: dict) -> dict:
    """Child fields override the base; nested mappings merge; lists are replaced whole."""
    out = dict(base)
    for k, v in child.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _resolved(file: Path) -> Path:
    """`file` made absolute with its links followed; a link cycle (which resolve() meets as a RuntimeError or, in
    newer Pythons, an OSError) is a RecipeError naming the file."""
    try:
        return file.resolve()
    except (RuntimeError, OSError):
        raise RecipeError(f"{file}: cannot read a recipe: its symbolic links form a loop") from None


def _load_raw(file: Path, chain: tuple[Path, ...]) -> tuple[dict, Marks]:
    file = _resolved(file)
    if file in chain:
        cycle = " -> ".join(p.name for p in chain + (file,))
        raise RecipeError(f"{chain[-1]}: extends cycle: {cycle}")
    data, marks = _read_yaml(file)
    parent = data.pop("extends", None)
    if parent is None:
        return data, marks
    if not isinstance(parent, str):
        f, line, col = marks[("extends",)]
        raise RecipeError(f"{f}:{line}:{col}: extends: expected a file name")
    base_file = (file.parent / parent)
    f, line, col = marks[("extends",)]
    if not base_file.exists():
        what = "is a symbolic link to nothing, or a link loop" if base_file.is_symlink() else "does not exist"
        raise RecipeError(f"{f}:{line}:{col}: extends: {parent} {what}")
    if not base_file.is_file():   # a FIFO would block the read, a device would never end
        raise RecipeError(f"{f}:{line}:{col}: extends: {parent} is not a regular file")
    base, base_marks = _load_raw(base_file, chain + (file,))
    merged_marks = dict(base_marks)
    merged_marks.update(marks)
    # A relative model path is relative to the file that wrote it, not to the file that extends it.
    for section in ("model", "port"):
        value = base.get(section)
        if isinstance(value, dict) and isinstance(value.get("path"), str):
            base = _merge(base, {section: {"path": str((base_file.parent / value["path"]).resolve())}})
    return _merge(base, data), merged_marks


def _locate(marks: Marks, loc: tuple, file: Path) -> str:
    for n in range(len(loc), -1, -1):
        if loc[:n] in marks:
            f, line, col = marks[loc[:n]]
            return f"{f}:{line}:{col}"
    return f"{file}:1:1"


def load_recipe(file: Path | str) -> LoadedRecipe:
    """Parse, merge `extends`, and validate one recipe file. Raises RecipeError naming file:line:column and field."""
    file = Path(file)
    data, marks = _load_raw(file, ())
    data.setdefault("name", file.stem)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and (x.startswith("function-after")
                                                                         or x in _SOURCE_TAGS.values())))
        field = ".".join(str(x) for x in loc) or "(recipe)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        raise RecipeError(f"{_locate(marks, loc, file)}: {field}: {msg}") from None
    return LoadedRecipe(recipe=recipe, path=_resolved(file))


def recipe_field_location(loaded: LoadedRecipe, field: str) -> str:
    """file:line:column of a dotted field in a loaded recipe (for errors found after schema validation)."""
    _, marks = _load_raw(loaded.path, ())
    loc = tuple(int(p) if p.isdigit() else p for p in field.split("."))
    return _locate(marks, loc, loaded.path)


def recipe_json_schema(backend_names: tuple[str, ...] = ()) -> dict:
    """The recipe's JSON Schema for editors; `backend_names` (qbuild.backends.NAMES) become the backend's enum."""
    schema = Recipe.model_json_schema()
    if backend_names:
        schema["properties"]["backend"]["enum"] = list(backend_names)
    schema["properties"]["extends"] = {"type": "string", "description": "a base recipe file this one overrides"}
    schema["required"] = [r for r in schema.get("required", []) if r != "name"]
    return schema
