"""The typed params of the neuron backend's own steps: the port, the compiles, and the package.

    PortGit                  the NxDI contrib port as a pinned git source: url, full commit, directory in it
    PortFiles / PortMissing  a local port directory's source files by digest (or where it was looked for)
    NeuronBlockKV            the port's block KV layout and hybrid APC manager a long-context compile builds
    NeuronSampling           NxDI's on-device sampling, as the Qwen3.5 ports compile it
    NeuronTextCompile        graph text: NxDI's one compile of every CTE and TKG bucket
    NeuronVisionCompile      graph vision: the port's traced vision encoder at one patch bucket
    NxdiTree                 the NxDI source tree a port imports from, where the recipe installs NxDI from source
    NeuronPackageParams      a bundle that is NxDI's compiled directory, loaded by the lineage's port
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from qbuild.core.dtypes import DType
from qbuild.core.errors import UserError
from qbuild.model.arch import Arch, VisionArch
from qbuild.model.families import MoEBackend
from qbuild.model.fp8 import FP8PolicyName
from qbuild.model.ranks import RankLayout
from qbuild.recipe.params import PackageParams
from qbuild.recipe.schema import LineageName, Target


@dataclass(frozen=True)
class PortGit:
    """A port pinned by its repository, commit and directory: the key a build of it has everywhere, known without
    reading the port (planning needs no network). The port step fetches it (qbuild.steps.port)."""

    url: str
    rev: str                         # the full 40-hex commit
    subdir: str                      # the port's directory in that commit (contrib/models/<Port>)


@dataclass(frozen=True)
class PortFiles:
    files: dict[str, str]            # relative path -> "blake3:<hex>" of each source file (tests excluded)

    def planned_files(self) -> dict[str, str]:
        return self.files


@dataclass(frozen=True)
class PortMissing:
    """A port planned where its directory does not exist, so that `plan` shows the whole graph; building it fails
    with one line saying where to put it."""

    missing: str                     # the recipe's port.path or port.module

    def planned_files(self) -> dict[str, str]:
        raise UserError(f"port: {self.missing} is not a directory here; check out the NxDI contrib port there "
                        "(aws-neuron/neuronx-distributed-inference, contrib/models/<Port>) or set port.path / "
                        "port.module in the recipe")


PortParams = Union[PortGit, PortFiles, PortMissing]


@dataclass(frozen=True)
class CompilerSettings:
    target: Target
    lnc: int                         # logical NeuronCore config (the recipe's, or the target's default)
    flags: tuple[str, ...]           # appended after the port's own compiler arguments


@dataclass(frozen=True)
class NeuronBlockKV:
    """What a long-context compile builds (qbuild.backends.neuron.long_context): attention KV in blocks, a
    prefix-caching KV layout whose context-encoding graphs take a cached prefix, and the port's bank of DeltaNet
    checkpoint slots."""

    block_size: int                  # NeuronConfig pa_block_size; vLLM --block-size
    num_blocks: int                  # NeuronConfig pa_num_blocks; vLLM --num-gpu-blocks-override
    checkpoint_interval: int         # the port's gdn_checkpoint_interval (equal to block_size: its APC v0)
    checkpoint_slots: int            # the port's max_gdn_checkpoint_slots
    prefix_buckets: tuple[int, ...]  # NeuronConfig prefix_buckets: the cached-prefix lengths a CTE graph takes


@dataclass(frozen=True)
class NeuronSampling:
    """NxDI's on-device sampling: NeuronConfig's on_device_sampling_config, which makes every compiled graph end in
    NxDI's sampler and return the chosen token instead of the logits (docs/nxdi.md section 21)."""

    top_k: int                       # OnDeviceSamplingConfig.top_k (do_sample stays off: an argmax)


@dataclass(frozen=True)
class NeuronTextCompile:
    graph: Literal["text"]
    backend: Literal["neuron"]
    lineage: LineageName
    text: Arch
    parallel: RankLayout             # NxD's world and degrees (qbuild.backends.neuron.config.rank_layout)
    dtype: DType
    fp8: FP8PolicyName
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
    block_kv: NeuronBlockKV | None   # chunked prefill's block KV layout (None: NxDI's contiguous KV cache)
    sampling: NeuronSampling | None  # on-device sampling (None: the graphs return logits)


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
    tp: int = 1                      # 1: torch_neuronx.trace on one core; more: NxD's parallel_model_trace over tp


NeuronCompile = Union[NeuronTextCompile, NeuronVisionCompile]


@dataclass(frozen=True)
class NxdiTree:
    """The NxDI a bundle's port needs where the recipe installs NxDI from a source tree (toolchain.from_source): the
    port's own repository at the port's commit, whose src/ holds the package (the Qwen3.6-27B port's launcher puts
    exactly that on PYTHONPATH: vllm/start_vllm_server.sh L120-123 @ 03db3ef)."""

    git: str | None                  # the repository (None: a port given by path or module)
    rev: str | None                  # its full commit
    version: str                     # what the tree's _version.py says: the recipe's pin


@dataclass(frozen=True)
class NeuronPackageParams(PackageParams):
    """A neuron bundle: NxDI's compiled directory, loaded by the lineage's port."""

    backend: Literal["neuron"]
    lineage: LineageName
    fp8: FP8PolicyName
    # The compile's block KV layout (serve.json's blocks, the checkpoint banks in the shards); with chunked prefill
    # `long_context` holds the chunk, and its prefix_cache only where vLLM serves prefix caching (neuron_apc).
    block_kv: NeuronBlockKV | None = field(default=None, kw_only=True)
    # The SDK release the recipe names (None: four versions), whose vLLM stack serves the bundle (releases.SERVING).
    sdk: str | None = field(default=None, kw_only=True)
    nxdi_tree: NxdiTree | None = field(default=None, kw_only=True)

    def bundle_meta(self) -> dict:
        return {**super().bundle_meta(), "lineage": self.lineage, "ranks": self.ranks}
