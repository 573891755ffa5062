"""Contract double of NxDI models/config.py (@ c63afe0, unchanged at main 4bcdc54): NeuronConfig, MoENeuronConfig,
InferenceConfig and how they are written to and read back from neuron_config.json.

Facts: docs/nxdi.md section 8 (save/load), 6 (every kwarg below, its default and its checks) and 7 (LNC,
platform target); docs/nxdi.md section 3 (BlockwiseMatmulConfig keys, router dtype); docs/nxdi.md section 14 (world size).
Where the real classes log and drop something, the double raises instead, except where NxDI itself relies on the
dropping (reading a saved config back: section 2).
"""

from __future__ import annotations

import enum
import json
import os

import torch

from neuronx_distributed_inference._double import DoubleRefusal, record

CONFIG_FILE = "neuron_config.json"   # cfg.py L23

# cfg.py to_torch_dtype: these names only, anything else is an assertion error.
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
# RouterConfig converts only these dtype names (NxD moe_configs.py, from 73ab227 / SDK 2.28).
_ROUTER_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# NxD's BlockwiseMatmulConfig.logical_nc_config defaults to DEFAULT_LNC_SIZE = get_platform_lnc(), evaluated when
# neuronx_distributed.modules.moe.model_utils is IMPORTED (model_utils.py L96, utils/model_utils.py L375-385): the
# environment at import time counts, not at construction. None here means the double cannot know the platform.
_IMPORT_TIME_LNC = os.environ.get("NEURON_LOGICAL_NC_CONFIG")

# Constructor calls that reach a saved config's keys pass this to get NxDI's log-and-drop behaviour for keys that are
# attributes but not constructor arguments (cfg.py from_json_string: "logged and dropped, then re-derived").
_ON_UNKNOWN = "_nxdi_double_on_unknown"


def to_torch_dtype(name: str) -> torch.dtype:
    assert name in _DTYPES, f"unsupported torch_dtype {name!r}"
    return _DTYPES[name]


def to_dict(obj):
    """cfg.py to_dict (L62-77): recurse into __dict__; a torch.dtype becomes its name ("bfloat16"); a class becomes
    {"__module__", "__name__"}. Enums (block_sharding_strategy) are not covered by the facts: the double writes their
    name, which is what the constructor accepts back."""
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return str(obj).split(".")[1]
    if isinstance(obj, type):
        return {"__module__": obj.__module__, "__name__": obj.__name__}
    if isinstance(obj, enum.Enum):
        return obj.name
    if hasattr(obj, "__dict__"):
        return {k: to_dict(v) for k, v in obj.__dict__.items()}
    return obj


def _leftover(cls_name: str, kwargs: dict, mode: str) -> None:
    """cfg.py: `if kwargs: logging.warning("NeuronConfig init: Unexpected keyword arguments: ...")` and they are
    dropped. The double raises, so a misspelt or non-existent setting (e.g. normalize_top_k_affinities, which is not a
    constructor argument) fails the compile instead of silently doing nothing. On the load path it drops them as
    NxDI does, and records what it dropped."""
    if not kwargs:
        return
    if mode == "drop":
        record("config_dropped_on_load", cls=cls_name, keys=sorted(kwargs))
        return
    raise TypeError(f"{cls_name} init: Unexpected keyword arguments: {sorted(kwargs)} (the real NxDI logs and drops "
                    "them; the contract double rejects them)")


class OnDeviceSamplingConfig:
    """cfg.py OnDeviceSamplingConfig; the fields of docs/nxdi.md section 8. Defaults the facts do not give are
    off (False / 1)."""

    def __init__(self, do_sample=False, top_k=1, top_p=1.0, temperature=1.0, dynamic=False, deterministic=False,
                 global_topk=256, top_k_kernel_enabled=False, sampling_dp_degree=1):
        self.do_sample, self.top_k, self.top_p, self.temperature = do_sample, top_k, top_p, temperature
        self.dynamic, self.deterministic, self.global_topk = dynamic, deterministic, global_topk
        self.top_k_kernel_enabled, self.sampling_dp_degree = top_k_kernel_enabled, sampling_dp_degree


class ChunkedPrefillConfig:
    """cfg.py ChunkedPrefillConfig (L1157-1172 @ 03db3ef): max_num_seqs 0, tkg_model_enabled True, kernel tiles of
    128 query and 1024 KV tokens. Unknown keys: the real class leaves them in its kwargs unread; the double refuses."""

    def __init__(self, **kwargs):
        self.max_num_seqs = kwargs.pop("max_num_seqs", 0)
        self.tkg_model_enabled = kwargs.pop("tkg_model_enabled", True)
        self.kernel_q_tile_size = kwargs.pop("kernel_q_tile_size", 128)
        self.kernel_kv_tile_size = kwargs.pop("kernel_kv_tile_size", 1024)
        if kwargs:
            raise TypeError(f"ChunkedPrefillConfig: unknown keys {sorted(kwargs)} (the contract double rejects them)")


class BlockShardingStrategy(enum.Enum):
    HI_LO = "HI_LO"
    PING_PONG = "PING_PONG"


class BlockwiseMatmulConfig:
    """NxD modules/moe/moe_configs.py BlockwiseMatmulConfig with exactly the keys docs/nxdi.md section 3 records.
    `from_kwargs` in NxD silently ignores unknown keys; the double rejects them (a misspelt kernel switch would
    otherwise select NxD's default kernel without a word)."""

    KEYS = ("block_size", "use_block_parallel", "logical_nc_config", "blockwise_nki_autograd_cls",
            "block_sharding_strategy", "skip_dma_token", "skip_dma_weight", "optimized_block_to_token_mapping",
            "use_torch_block_wise", "parallelize_token_to_block_mapping",
            "always_augment_inputs_for_blockwise_matmul", "use_shard_on_intermediate_dynamic_while",
            "use_shard_on_block_dynamic_while", "num_static_blocks", "pad_num_blocks_to_even")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "BlockwiseMatmulConfig":
        unknown = sorted(set(kwargs) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"blockwise_matmul_config: unknown keys {unknown} (NxD ignores them silently; the "
                             "contract double rejects them)")
        self = cls()
        self.block_size = kwargs.pop("block_size", 512)
        lnc = kwargs.pop("logical_nc_config", None)
        if lnc is None:
            if _IMPORT_TIME_LNC is None:
                raise DoubleRefusal("blockwise_matmul_config.logical_nc_config defaults to the compile host's LNC "
                                    "(NxD get_platform_lnc at import); the double cannot know it: pass it, or set "
                                    "NEURON_LOGICAL_NC_CONFIG before importing NxDI")
            lnc = int(_IMPORT_TIME_LNC)
        self.logical_nc_config = int(lnc)
        strategy = kwargs.pop("block_sharding_strategy", None)
        if isinstance(strategy, str):
            if strategy not in BlockShardingStrategy.__members__:
                raise ValueError(f"block_sharding_strategy: {strategy!r} is not HI_LO or PING_PONG")
            strategy = BlockShardingStrategy[strategy]
        self.block_sharding_strategy = strategy
        # moe_configs.py:96: kwargs.pop("parallelize_token_to_block_mapping", True) (docs/nxdi.md section 14).
        self.parallelize_token_to_block_mapping = kwargs.pop("parallelize_token_to_block_mapping", True)
        self.blockwise_nki_autograd_cls = kwargs.pop("blockwise_nki_autograd_cls", None)
        self.num_static_blocks = kwargs.pop("num_static_blocks", None)
        for key in cls.KEYS:   # the remaining switches: defaults not recorded, so off
            if not hasattr(self, key):
                setattr(self, key, kwargs.pop(key, False))
        return self


class RouterConfig:
    """NxD RouterConfig: act_fn "softmax", dtype fp32; a string dtype is converted (float32/float16/bfloat16)."""

    def __init__(self, act_fn: str = "softmax", dtype=torch.float32):
        if isinstance(dtype, str):
            assert dtype in _ROUTER_DTYPES, f"router dtype {dtype!r}"
            dtype = _ROUTER_DTYPES[dtype]
        self.act_fn = act_fn
        self.dtype = dtype


def _get_lnc(kwargs: dict) -> int:
    """cfg.py _get_lnc (L730): env NEURON_LOGICAL_NC_CONFIG > kwarg (int(); deprecated alias logical_neuron_cores)
    > platform (trn2/trn3 -> 2, else 1). The double cannot see the platform, so it refuses to guess; and where the env
    and the kwarg disagree (NxDI silently takes the env) it raises, since one of the two is then ignored."""
    kwarg = kwargs.pop("logical_nc_config", None)
    alias = kwargs.pop("logical_neuron_cores", None)
    kwarg = kwarg if kwarg is not None else alias
    env = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if env is not None and kwarg is not None and int(env) != int(kwarg):
        raise ValueError(f"logical_nc_config={kwarg} but NEURON_LOGICAL_NC_CONFIG={env}: NxDI takes the environment "
                         "and ignores the argument")
    if env is not None:
        return int(env)
    if kwarg is not None:
        return int(kwarg)
    raise DoubleRefusal("logical_nc_config: neither NEURON_LOGICAL_NC_CONFIG nor logical_nc_config is set, and the "
                        "double cannot detect the platform's LNC")


class NeuronConfig:
    """cfg.py NeuronConfig(**kwargs) with the kwargs and defaults of docs/nxdi.md section 8."""

    def __init__(self, **kwargs):
        mode = kwargs.pop(_ON_UNKNOWN, "raise")
        if type(self) is NeuronConfig:
            record("NeuronConfig", cls="NeuronConfig", kwargs=to_dict(kwargs), load_path=mode == "drop")
        self.batch_size = kwargs.pop("batch_size", 1)
        self.seq_len = kwargs.pop("seq_len", 128)
        self.n_positions = kwargs.pop("n_positions", self.seq_len)
        self.max_context_length = kwargs.pop("max_context_length", self.seq_len)
        self.max_new_tokens = kwargs.pop("max_new_tokens", self.seq_len - self.max_context_length)
        if self.max_new_tokens == 0:
            self.max_new_tokens = None
        self.max_length = kwargs.pop("max_length", self.seq_len)
        assert self.max_context_length <= self.max_length, "max_context_length must be <= max_length"
        self.ctx_batch_size = kwargs.pop("ctx_batch_size", self.batch_size)
        self.tkg_batch_size = kwargs.pop("tkg_batch_size", self.batch_size)
        self.max_batch_size = kwargs.pop("max_batch_size", self.batch_size)

        dtype = kwargs.pop("torch_dtype", None)
        self.overrides_torch_dtype = dtype is not None
        if dtype is None:
            dtype = torch.bfloat16
        elif isinstance(dtype, str):
            dtype = to_torch_dtype(dtype)
        assert isinstance(dtype, torch.dtype), f"torch_dtype {dtype!r}"
        self.torch_dtype = dtype

        self.fused_qkv = kwargs.pop("fused_qkv", False)
        sampling = kwargs.pop("on_device_sampling_config", None)
        if type(sampling) is dict:
            sampling = OnDeviceSamplingConfig(**sampling)
        self.on_device_sampling_config = sampling
        self.output_logits = kwargs.pop("output_logits", False)   # section 9 (mbase.py L630-636)

        self.enable_bucketing = kwargs.pop("enable_bucketing", False)
        self.context_encoding_buckets = kwargs.pop("context_encoding_buckets", None)
        self.token_generation_buckets = kwargs.pop("token_generation_buckets", None)
        if self.context_encoding_buckets is not None:
            self.context_encoding_buckets.sort()   # sorted in place, as cfg.py does
            assert self.context_encoding_buckets[-1] <= self.max_context_length, \
                "context_encoding_buckets: the largest bucket must be <= max_context_length"
        if self.token_generation_buckets is not None:
            self.token_generation_buckets.sort()
            assert self.token_generation_buckets[-1] <= self.max_length, \
                "token_generation_buckets: the largest bucket must be <= max_length"

        self.quantized = kwargs.pop("quantized", False)
        self.quantized_checkpoints_path = kwargs.pop("quantized_checkpoints_path", None)
        self.quantization_type = kwargs.pop("quantization_type", "per_tensor_symmetric")
        self.quantization_dtype = kwargs.pop("quantization_dtype", "int8")
        self.modules_to_not_convert = kwargs.pop("modules_to_not_convert", None)
        self.kv_cache_quant = kwargs.pop("kv_cache_quant", False)
        # PR 173 qwen36_27b_compile_fp8.py @ 03db3ef passes these to NeuronConfig (docs/nxdi.md section 16).
        self.kv_quant_config = kwargs.pop("kv_quant_config", None)
        self.quantized_mlp_kernel_enabled = kwargs.pop("quantized_mlp_kernel_enabled", False)
        self.activation_quantization_type = kwargs.pop("activation_quantization_type", None)
        if self.quantized:
            assert self.quantized_checkpoints_path is not None, "quantized_checkpoints_path is required"

        self.tp_degree = kwargs.pop("tp_degree", 1)
        self.cp_degree = kwargs.pop("cp_degree", 1)
        self.attention_dp_degree = kwargs.pop("attention_dp_degree", 1)
        self.pp_degree = kwargs.pop("pp_degree", 1)
        self.ep_degree = kwargs.pop("ep_degree", 1)
        # config.py L382-390 (docs/nxdi.md section 14): one shard file per global rank.
        self.world_size = kwargs.pop("world_size", None)
        if self.world_size is None:
            self.world_size = self.tp_degree * self.pp_degree * self.ep_degree
        self.local_ranks_size = kwargs.pop("local_ranks_size", None)
        if self.local_ranks_size is None:
            self.local_ranks_size = self.world_size

        self.save_sharded_checkpoint = kwargs.pop("save_sharded_checkpoint", False)
        self.skip_sharding = kwargs.pop("skip_sharding", False)
        self.flash_decoding_enabled = kwargs.pop("flash_decoding_enabled", False)
        self.logical_nc_config = _get_lnc(kwargs)
        self.target = kwargs.pop("target", None)
        self.weights_to_skip_layout_optimization = kwargs.pop("weights_to_skip_layout_optimization", [])
        self.vocab_parallel = kwargs.pop("vocab_parallel", False)   # default not recorded, so off
        self._block_kv_layout(kwargs)
        self.weight_gather_seq_len_threshold = kwargs.pop("weight_gather_seq_len_threshold", 32768)   # config.py l.154
        # What vllm-neuron's default NeuronConfig passes besides the above (its loader L1093-1113 @ 3afb0a9):
        # config.py L95, L164, L356 @ c63afe0.
        self.padding_side = kwargs.pop("padding_side", "right")
        self.is_continuous_batching = kwargs.pop("is_continuous_batching", False)
        self.lora_config = kwargs.pop("lora_config", None)
        # config.py l.614: long-context mode is NxDI core, from max_context_length alone.
        self.enable_long_context_mode = self.max_context_length >= 32 * 1024
        self.scratchpad_page_size = kwargs.pop("scratchpad_page_size", 1024 if self.enable_long_context_mode else None)
        # Attributes the ports and NxDI read that are not constructor arguments in the facts.
        self.disable_numeric_cc_token = False
        self.skip_warmup = False
        self._setup_kernel_target_platform()
        _leftover(type(self).__name__, kwargs, mode)

    def _block_kv_layout(self, kwargs: dict) -> None:
        """The paged (block) KV layout, prefix caching and NxDI's own chunked prefill, with the defaults and checks of
        NxDI models/config.py @ 03db3ef (docs/long-context.md section 5): prefix_buckets and the (active, prefix)
        pairs (L193-196, their bounds L233-262), the prefix-CTE attention backend (L198-207), pa_num_blocks defaulting
        to the batch size and pa_block_size to seq_len (L342-348), chunked_prefill_config built from a dict and
        needing the block layout (L359-383)."""
        self.prefix_buckets = kwargs.pop("prefix_buckets", None)
        self.context_encoding_bucket_pairs = kwargs.pop("context_encoding_bucket_pairs", None)
        for active, prefix in self.context_encoding_bucket_pairs or []:
            assert 0 < active <= self.max_context_length and 0 <= prefix <= self.max_context_length, \
                f"context encoding bucket pair {[active, prefix]} out of (0, {self.max_context_length}]"
        self.prefix_cte_attention_backend = kwargs.pop("prefix_cte_attention_backend", "attention_cte")
        assert self.prefix_cte_attention_backend in ("attention_cte", "segmented_cte"), \
            "prefix_cte_attention_backend must be one of attention_cte or segmented_cte"
        self.is_block_kv_layout = kwargs.pop("is_block_kv_layout", False)
        self.pa_num_blocks = kwargs.pop("pa_num_blocks", self.batch_size)
        self.pa_block_size = kwargs.pop("pa_block_size", self.seq_len)
        self.is_prefix_caching = kwargs.pop("is_prefix_caching", False)
        chunked = kwargs.pop("chunked_prefill_config", None)
        self.chunked_prefill_config = ChunkedPrefillConfig(**chunked) if type(chunked) is dict else chunked
        self.is_chunked_prefill = self.chunked_prefill_config is not None
        if self.is_chunked_prefill:
            assert self.is_block_kv_layout, "is_block_kv_layout has to be true for chunked prefill because it " \
                                            "depends on block KV"
            if not self.chunked_prefill_config.tkg_model_enabled:
                assert self.batch_size == 1, "batch_size has to be 1 for chunked prefill CTE model"

    def _setup_kernel_target_platform(self) -> None:
        """cfg.py L723-727 sets NEURON_PLATFORM_TARGET_OVERRIDE (if unset) to the host's platform; a compile host
        without a device has none the double could report, so it must be set by the caller."""
        if not os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE"):
            raise DoubleRefusal("NEURON_PLATFORM_TARGET_OVERRIDE is unset: NxDI would set it from the host's platform, "
                                "which the double cannot detect; set it (and NEURON_LOGICAL_NC_CONFIG) before "
                                "importing NxDI")


class MoENeuronConfig(NeuronConfig):
    """cfg.py MoENeuronConfig(capacity_factor=None, glu_mlp=True, **kwargs) (L798-846)."""

    def __init__(self, capacity_factor=None, glu_mlp=True, **kwargs):
        mode = kwargs.get(_ON_UNKNOWN, "raise")
        record("NeuronConfig", cls=type(self).__name__,
               kwargs=to_dict(dict(kwargs, capacity_factor=capacity_factor, glu_mlp=glu_mlp)) if mode != "drop"
               else to_dict(kwargs), load_path=mode == "drop")
        self.capacity_factor = float(capacity_factor) if capacity_factor is not None else None
        self.glu_mlp = glu_mlp
        self.moe_tp_degree = kwargs.pop("moe_tp_degree", 1)
        self.moe_ep_degree = kwargs.pop("moe_ep_degree", 1)
        # Not a constructor argument: derived from disable_normalize_top_k_affinities (absent -> True).
        self.normalize_top_k_affinities = not kwargs.pop("disable_normalize_top_k_affinities", False)
        blockwise = kwargs.pop("blockwise_matmul_config", {})
        if isinstance(blockwise, dict):
            blockwise = BlockwiseMatmulConfig.from_kwargs(**blockwise)
        self.blockwise_matmul_config = blockwise
        router = kwargs.pop("router_config", None)
        if isinstance(router, dict):
            router = RouterConfig(**router)
        elif router is None:
            # RouterConfig.from_kwargs reads router_act_fn / router_dtype from a COPY of the kwargs, so NeuronConfig
            # then logs them as unexpected; the double's NeuronConfig rejects them (set the attributes instead, as the
            # ports do).
            router = RouterConfig(kwargs.get("router_act_fn", "softmax"), kwargs.get("router_dtype", torch.float32))
        self.router_config = router
        super().__init__(**kwargs)
        blockwise_lnc = self.blockwise_matmul_config.logical_nc_config
        if blockwise_lnc != self.logical_nc_config:
            # docs/nxdi.md section 2: its default is the compile host's LNC, not NeuronConfig's; a difference means the
            # MoE kernels are built for another LNC than the model.
            raise ValueError(f"blockwise_matmul_config.logical_nc_config={blockwise_lnc} differs from "
                             f"logical_nc_config={self.logical_nc_config}")


class InferenceConfig:
    """cfg.py InferenceConfig(neuron_config, fused_spec_config=None, load_config=None, metadata=None, **kwargs)
    (L853-876): load_config hook, then every kwarg as an attribute, then add_derived_config, then validate_config."""

    def __init__(self, neuron_config, fused_spec_config=None, load_config=None, metadata=None, **kwargs):
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()
        record("InferenceConfig", cls=type(self).__name__, neuron_config_cls=type(self.neuron_config).__name__,
               keys=sorted(kwargs))

    def load_config(self) -> None:
        pass

    def add_derived_config(self) -> None:
        self.num_cores_per_group = 1

    def get_required_attributes(self) -> list[str]:
        return []

    def validate_config(self) -> None:
        missing = [x for x in self.get_required_attributes() if not hasattr(self, x)]
        assert len(missing) == 0, f"Config must define {missing}"

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig

    def save(self, model_path: str) -> None:
        """cfg.py L927-944: <model_path>/neuron_config.json = json.dumps(to_dict(self), indent=2, sort_keys=True)
        + "\\n". The directory must exist (whether NxDI creates it is not recorded)."""
        config_file = os.path.join(model_path, CONFIG_FILE)
        with open(config_file, "w") as f:
            f.write(json.dumps(to_dict(self), indent=2, sort_keys=True) + "\n")
        record("InferenceConfig.save", path=config_file)

    @classmethod
    def load(cls, model_path: str, **kwargs) -> "InferenceConfig":
        record("InferenceConfig.load", cls=cls.__name__, path=os.path.join(model_path, CONFIG_FILE))
        with open(os.path.join(model_path, CONFIG_FILE)) as f:
            return cls.from_json_string(f.read(), **kwargs)

    @classmethod
    def from_json_string(cls, json_string: str, **kwargs) -> "InferenceConfig":
        """cfg.py L966-1039: the saved dict plus kwargs; neuron_config through get_neuron_config_cls() (attributes that
        are not constructor arguments are logged and dropped); the HF config.json is not read again."""
        merged = json.loads(json_string)
        merged.update(kwargs)
        neuron_config = cls.get_neuron_config_cls()(**merged.pop("neuron_config"), **{_ON_UNKNOWN: "drop"})
        return cls(neuron_config=neuron_config, **merged)
