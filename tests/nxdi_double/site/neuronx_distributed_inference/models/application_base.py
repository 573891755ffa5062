"""Contract double of NxDI models/application_base.py (@ ef2731e) and of the NxD ModelBuilder.trace it drives.

compile() follows docs/nxdi.md section 9 step by step: neuron_config.json first, then trace (which wipes
BASE_COMPILE_WORK_DIR: section 4) with every bucket of every submodel, token-generation bucket 0 first (the priority /
weight-layout model), each NEFF through the persistent compile cache (section 3), then the configs into the work dir,
then model.pt, then sharding only if save_sharded_checkpoint and not skip_sharding. load() follows section 2: model.pt,
then weights/tp{r}_sharded_checkpoint.safetensors for every rank, checked against the weights the compiled model takes
(as nxd_model.initialize would fail on them), then every value against the HF checkpoint the bundle was built from
(_values.py).

The double cannot compile: a "NEFF" is a small file named by its cache key. The key is built the way NxD builds it
(section 3: sha256 of the HLO text and the flags without spaces, the flags carrying `--logfile=<absolute work dir>/
<tag>/_tp0_bk<i>/log-neuron-cc.txt`), with the "HLO" standing for what the traced graph depends on: the tag, the
bucket, the whole config except the bucket lists, the port's model source, the port switches read while tracing, and
(for every bucket but the priority one) the priority model's key, whose layout transforms NxD appends before hashing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import shlex
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from neuronx_distributed_inference._double import DoubleRefusal, env_snapshot, record, settings
from neuronx_distributed_inference._nxd import Weight, rank_value
from neuronx_distributed_inference.models.config import to_dict

COMPILED_MODEL_FILE_NAME = "model.pt"
# Inside model.pt (torch.jit extra file): what the double compiled. The real model.pt embeds NEFFs and metaneffs.
COMPILED_SPEC = "nxdi_double/compiled.json"
DEFAULT_WORK_DIR = "/tmp/nxd_model/"
# metaneff DataType per weight dtype (docs/nxdi.md section 11). float16 is not among the recorded values.
_DATA_TYPES = {"float32": 1, "int32": 2, "bfloat16": 14, "float8_e4m3fn": 15, "float8_e5m2": 16}


def normalize_path(path: str) -> str:
    """ab.py: normpath plus a trailing "/"; the path is not checked."""
    return os.path.normpath(str(path)) + "/"


def is_compiled(model_path: str) -> bool:
    return os.path.isfile(model_path + COMPILED_MODEL_FILE_NAME)


@dataclass
class Submodel:
    tag: str
    buckets: list[int]
    auto_buckets: bool
    compiler_args: str | None     # what get_compiler_args() returned when the submodel was enabled
    priority: bool                # priority_model_idx=0: bucket 0 is the weight-layout model
    batch_size: int
    seq_len_is_bucket: bool       # CTE traces the bucket's tokens; TKG one token


def _active_tokens(sub: Submodel, bucket) -> int:
    """The tokens one row of a bucket's graph takes: the bucket (CTE), its active part where it is an (active, prefix)
    pair of prefix caching, or one (TKG)."""
    if not sub.seq_len_is_bucket:
        return 1
    return bucket[0] if isinstance(bucket, list) else bucket


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[1]


def _cache_root() -> str | None:
    """The persistent compile cache (neuron-caching.rst @ 539a73c5): `--cache_dir=` in NEURON_CC_FLAGS wins over
    NEURON_COMPILE_CACHE_URL; `--no_cache` disables it. The real default is /var/tmp/neuron-compile-cache; the double
    refuses to fall back to it (a test must never write there), and cannot reach s3:// URLs."""
    flags = os.environ.get("NEURON_CC_FLAGS", "")
    if re.search(r"(^|\s)--no_cache(\s|$)", flags):
        return None
    match = re.search(r"(?:^|\s)--cache_dir[= ](\S+)", flags)
    url = match.group(1) if match else os.environ.get("NEURON_COMPILE_CACHE_URL")
    if not url:
        raise DoubleRefusal("no compile cache: set NEURON_COMPILE_CACHE_URL (the real SDK would use "
                            "/var/tmp/neuron-compile-cache)")
    if url.startswith("s3://"):
        raise DoubleRefusal(f"compile cache {url}: the double cannot reach S3")
    return url


def _flag_value(args: str, flag: str) -> str | None:
    match = re.search(rf"(?:^|\s){re.escape(flag)}(?:=|\s+)(\S+)", args)
    return match.group(1) if match else None


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _barrier() -> None:
    """A "barrier": "<dir>:<n>" setting (_double.settings) holds every compile inside trace until n have arrived, so a
    test can prove two compiles really ran at the same time (and so needed distinct work dirs)."""
    spec = settings().get("barrier")
    if not spec:
        return
    directory, n = spec.rsplit(":", 1)
    os.makedirs(directory, exist_ok=True)
    Path(directory, str(os.getpid())).touch()
    deadline = time.monotonic() + 300
    while len(os.listdir(directory)) < int(n):
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier {directory}: {len(os.listdir(directory))} of {n} compiles arrived")
        time.sleep(0.05)


class NeuronApplicationBase:
    """ab.py NeuronApplicationBase(model_path, config=None, neuron_config=None) (L73-101)."""

    _model_cls = None   # the port's model: rank_weights(config) and trace(config, tag, bucket, tokens, seq_len)

    def __init__(self, model_path, config=None, neuron_config=None):
        model_path = normalize_path(model_path)
        loaded = config is None
        if config is None:
            config = self.get_config_cls().load(model_path)   # <model_path>/neuron_config.json
        if neuron_config is not None:
            config.neuron_config = neuron_config
        self.validate_config(config)
        self.config = config
        self.neuron_config = config.neuron_config
        self.model_path = model_path
        self.is_compiled = is_compiled(model_path)
        self.is_loaded = False
        self.traced_model = None
        self.submodels: list[Submodel] = []
        record("app_init", cls=type(self).__name__, mro=[f"{c.__module__}.{c.__name__}" for c in type(self).__mro__],
               files={f"{c.__module__}.{c.__name__}": inspect.getfile(c) for c in type(self).__mro__[:-1]},
               model_path=model_path, config_from_json=loaded, config_cls=type(config).__name__,
               neuron_config_cls=type(config.neuron_config).__name__)

    @classmethod
    def validate_config(cls, config) -> None:
        assert getattr(config, "neuron_config", None) is not None, "config must have a neuron_config"

    @classmethod
    def get_config_cls(cls):
        raise NotImplementedError("get_config_cls")

    @classmethod
    def get_neuron_config_cls(cls):
        """ab.py L224-226 @ ef2731e: the config class's (vllm-neuron builds its NeuronConfig with it)."""
        return cls.get_config_cls().get_neuron_config_cls()

    def get_compiler_args(self):
        return None

    # --- compile ----------------------------------------------------------------------------------------------
    def compile(self, compiled_model_path, debug=False, pre_shard_weights_hook=None, dry_run=False,
                disable_fail_fast=False):
        """ab.py L292-316, in this order."""
        out = normalize_path(compiled_model_path)
        self.config.save(out)                                          # 1) <out>/neuron_config.json
        neffs, work_dir, weights = self._trace()                       # 2) every bucket of every submodel
        self._save_configs_to_compiler_workdir(work_dir)               # 3)
        record("compile", cls=type(self).__name__, mro=[c.__name__ for c in type(self).__mro__], out=out,
               work_dir=work_dir, dry_run=dry_run,
               submodels=[{"tag": s.tag, "buckets": s.buckets, "auto_buckets": s.auto_buckets,
                           "compiler_args": s.compiler_args, "priority": s.priority} for s in self.submodels],
               neffs=neffs, config=to_dict(self.config), weights=len(weights))
        if dry_run:
            return
        spec = {"world_size": self.neuron_config.world_size, "tp_degree": self.neuron_config.tp_degree,
                "app": type(self).__name__, "neffs": neffs, "graph_config": graph_config(self.config),
                "weights": {name: w.to_json() for name, w in sorted(weights.items())}}
        with warnings.catch_warnings():     # torch marks torch.jit deprecated; NxDI's model.pt is a TorchScript file
            warnings.simplefilter("ignore", DeprecationWarning)
            traced = torch.jit.trace(_CompiledModel(), (torch.zeros(1),))
            torch.jit.save(traced, out + COMPILED_MODEL_FILE_NAME,       # 4) <out>/model.pt
                           _extra_files={COMPILED_SPEC: json.dumps(spec, sort_keys=True)})
        self.shard_weights(out, debug, pre_shard_weights_hook)         # 5) last
        self.is_compiled = True

    def _trace(self):
        """NxD ModelBuilder.trace as the facts describe it; returns (NEFFs, work dir, weights)."""
        work_dir = os.environ.get("BASE_COMPILE_WORK_DIR")
        if not work_dir:
            # NxDI falls back to /tmp/nxd_model/ and trace() wipes it: two compiles on one host would destroy each
            # other's NEFFs. The double makes the caller choose.
            raise DoubleRefusal(f"BASE_COMPILE_WORK_DIR is unset: the real SDK would wipe and use {DEFAULT_WORK_DIR}")
        work_dir = normalize_path(work_dir)
        busy = work_dir.rstrip("/") + ".nxdi-double-busy"
        try:
            fd = os.open(busy, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            # The real trace would silently wipe the other compile's NEFFs; the double fails instead.
            raise RuntimeError(f"BASE_COMPILE_WORK_DIR {work_dir} is in use by another compile "
                               f"({Path(busy).read_text().strip() or 'unknown pid'})") from None
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        try:
            _barrier()
            if os.path.exists(work_dir):                 # MB L543-545
                shutil.rmtree(work_dir)
            os.makedirs(work_dir)
            return self._compile_all(work_dir)
        finally:
            os.unlink(busy)

    def _compile_all(self, work_dir: str):
        model_cls = self._model_cls
        weights: dict[str, Weight] = model_cls.rank_weights(self.config)
        cache = _cache_root()
        cc_version = importlib.metadata.version("neuronx-cc")
        model_config = to_dict(self.config)
        for key in ("context_encoding_buckets", "token_generation_buckets"):
            model_config["neuron_config"].pop(key)
        common = {"config": model_config,
                  "port_model": hashlib.sha256(Path(inspect.getfile(model_cls)).read_bytes()).hexdigest(),
                  "port_env": {k: v for k, v in env_snapshot().items() if k.startswith("QWEN36_")},
                  "weights": {name: w.to_json() for name, w in sorted(weights.items())}}
        jobs = []   # (submodel, index, bucket, is the priority model)
        for sub in self.submodels:
            jobs += [(sub, i, b, sub.priority and i == 0) for i, b in enumerate(sub.buckets)]
        jobs.sort(key=lambda job: not job[3])           # the priority model compiles first (mbase.py L3147)
        neffs, layout_key = [], None
        for sub, index, bucket, priority in jobs:
            active = _active_tokens(sub, bucket)
            traced = model_cls.trace(self.config, sub.tag, bucket, sub.batch_size * active, active)
            neff = self._compile_bucket(work_dir, sub, index, bucket, priority, common, traced, layout_key, cache,
                                        cc_version)
            if priority:
                layout_key = neff["key"]
            neffs.append(neff)
        for neff in neffs:                              # metaneff.pb after every compile finished (MB L760-767)
            self._write_metaneff(neff["dir"], weights, neff["tokens_shape"])
        return neffs, work_dir, weights

    def _compiler_flags(self, sub: Submodel, bucket_dir: str, priority: bool) -> str:
        """The flags NxD hashes and passes to neuronx-cc for one bucket (docs/nxdi.md section 10)."""
        args = sub.compiler_args
        if args is None:
            raise DoubleRefusal("get_compiler_args() returned None: the double does not build NxDI's default "
                                "arguments (model_wrapper.py); every Qwen port returns its own")
        nc = self.neuron_config
        lnc, target = _flag_value(args, "--lnc"), _flag_value(args, "--target")
        if lnc is not None and int(lnc) != nc.logical_nc_config:
            raise ValueError(f"compiler args --lnc={lnc} but logical_nc_config={nc.logical_nc_config}")
        platform = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
        if target is not None and target != platform:
            raise ValueError(f"compiler args --target={target} but NEURON_PLATFORM_TARGET_OVERRIDE={platform}")
        # ModelWrapper, with or without the app's own arguments (mw.py L86-165).
        fp8 = (nc.quantized and nc.quantization_dtype == "f8e4m3") or nc.kv_cache_quant or \
            nc.quantized_mlp_kernel_enabled or nc.activation_quantization_type
        # mw.py @ 4bcdc54 L147-160: the FP8 flag goes inside the hlo2tensorizer options.
        hlo2tensorizer = " --experimental-unsafe-fp8e4m3fn-as-fp8e4m3 " if fp8 else ""
        if hlo2tensorizer:
            args += f" --internal-hlo2tensorizer-options='{hlo2tensorizer} --verify-hlo=true' "
        else:
            args += " --internal-hlo2tensorizer-options='--verify-hlo=true' "
        # ModelBuilder.add -> append_default_compiler_flags (MB L104-124), then trace (MB L643-644, L721-722).
        if "--auto-cast" not in args:
            args += " --auto-cast=none"
        if not re.search(r"(^|\s)-O\d", args):
            args += " -O1"
        args += " --verbose=35"
        if "--logfile" not in args:
            args += f" --logfile={Path(bucket_dir, 'log-neuron-cc.txt').absolute()}"
        if priority:
            args += " --enable-internal-neff-wrapper"
        _refuse_repeated_options(args)
        return args

    def _compile_bucket(self, work_dir, sub, index, bucket, priority, common, traced, layout_key, cache, cc_version):
        bucket_dir = os.path.join(work_dir, sub.tag, f"_tp0_bk{index}")
        os.makedirs(os.path.join(bucket_dir, "model"))
        flags = self._compiler_flags(sub, bucket_dir, priority)
        hlo = json.dumps({**common, "tag": sub.tag, "bucket": bucket, "traced": traced,
                          "weight_layout": None if priority else layout_key}, sort_keys=True)
        key = hashlib.sha256((hlo + flags.replace(" ", "")).encode()).hexdigest()[:20]   # get_hash_module (MB L93-101)
        neff = f"nxdi-double NEFF {key}\n".encode()
        hit, entry = False, None
        if cache is not None:
            # <cache>/neuronxcc-<compiler version>/MODULE_<key>+<8-hex flags hash>/ (neuron-caching.rst), holding
            # what the wrapper writes: the HLO, the flags, the NEFF, then model.done; model.log without a NEFF is a
            # failed compile, which the wrapper reuses as a failure (docs/nxdi.md section 10).
            entry = os.path.join(cache, f"neuronxcc-{cc_version}",
                                 f"MODULE_{key}+{hashlib.md5(flags.encode()).hexdigest()[:8]}")
            def has(name: str) -> bool:
                return os.path.isfile(os.path.join(entry, name))

            done = has("model.neff") and has("model.done")
            if has("model.log") and not has("model.neff") and \
                    "--retry_failed_compilation" not in os.environ.get("NEURON_CC_FLAGS", ""):
                raise RuntimeError(f"Got a cached failed neff at {entry}/model.neff. Will skip compilation, please set "
                                   "--retry_failed_compilation for recompilation.")
            hit = done
            if not hit:
                os.makedirs(entry, exist_ok=True)
                _write(os.path.join(entry, "model.hlo_module.pb"), hlo.encode())
                _write(os.path.join(entry, "compile_flags.json"), json.dumps(flags.split()).encode())
                _write(os.path.join(entry, "model.neff"), neff)
                _write(os.path.join(entry, "model.done"), b"")
        _write(os.path.join(bucket_dir, "graph.neff"), neff)
        _write(os.path.join(bucket_dir, "model", "graph.hlo"), hlo.encode())
        _write(os.path.join(bucket_dir, "log-neuron-cc.txt"), flags.encode() + b"\n")
        rows = sub.batch_size, _active_tokens(sub, bucket)
        return {"tag": sub.tag, "index": index, "bucket": bucket, "priority": priority, "key": key, "hit": hit,
                "cache_entry": entry, "flags": flags, "dir": bucket_dir, "tokens_shape": list(rows),
                "traced": traced}

    def _write_metaneff(self, bucket_dir: str, weights: dict[str, Weight], tokens_shape: list[int]) -> None:
        """metaneff.pb: the graph's inputs (docs/nxdi.md section 11). The weights are INPUT_WEIGHT entries with
        the shard key as bytes and the per-rank shape; the user input and a state input are there too, so a reader
        must filter by type."""
        from torch_neuronx.proto import metaneff_pb2

        meta = metaneff_pb2.MetaNeff()
        meta.input_tensors.add(name=b"input_ids", shape=tokens_shape, data_type=_DATA_TYPES["int32"],
                               type=metaneff_pb2.MetaTensor.Type.USER_INPUT, user_input_key=b"input_ids")
        meta.input_tensors.add(name=b"kv_mgr.past_key_values.0", shape=[1], data_type=_DATA_TYPES["bfloat16"],
                               checkpoint_key=b"kv_mgr.past_key_values.0",
                               type=metaneff_pb2.MetaTensor.Type.INPUT_STATE)
        for name, w in sorted(weights.items()):
            if w.dtype not in _DATA_TYPES:
                raise DoubleRefusal(f"{name}: dtype {w.dtype} has no recorded metaneff DataType")
            meta.input_tensors.add(name=name.encode(), shape=list(w.shape), data_type=_DATA_TYPES[w.dtype],
                                   checkpoint_key=name.encode(), type=metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT)
        _write(os.path.join(bucket_dir, "metaneff.pb"), meta.SerializeToString())

    def _save_configs_to_compiler_workdir(self, work_dir: str) -> None:
        """ab.py L267-290: the config into the work dir, and per bucket with `buckets=[size]`."""
        self.config.save(work_dir)
        for sub in self.submodels:
            for index, bucket in enumerate(sub.buckets):
                doc = to_dict(self.config)
                doc["neuron_config"]["buckets"] = [bucket]
                path = os.path.join(work_dir, sub.tag, f"_tp0_bk{index}", "neuron_config.json")
                _write(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())

    def shard_weights(self, compiled_model_path, debug=False, pre_shard_weights_hook=None) -> None:
        """ab.py L240-265. With sharding on, NxD would read the whole checkpoint (ab.py checkpoint_loader_fn); the
        double cannot, and a qbuild compile must never get here (its shard step writes weights/)."""
        if pre_shard_weights_hook:
            pre_shard_weights_hook(self)
        nc = self.neuron_config
        if nc.skip_sharding:
            record("shard_weights", skipped="skip_sharding")
        elif not nc.save_sharded_checkpoint:
            record("shard_weights", skipped="save_sharded_checkpoint=False: sharded during load")
        else:
            source = getattr(self.config, "_name_or_path", None) or self.model_path
            raise DoubleRefusal(f"compile() would shard the checkpoint now (save_sharded_checkpoint=True, "
                                f"skip_sharding=False) and read it from {source}")

    # --- load -------------------------------------------------------------------------------------------------
    def load(self, compiled_model_path, start_rank_id=None, local_ranks_size=None, skip_warmup=False):
        """ab.py L318-347 and load_weights L375-421."""
        path = normalize_path(compiled_model_path)
        model_file = path + COMPILED_MODEL_FILE_NAME
        if settings().get("load_error"):     # a fault injection point: the load fails as a damaged directory would
            raise ValueError(settings()["load_error"])
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"{model_file}: no compiled model")
        extra = {COMPILED_SPEC: ""}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.traced_model = torch.jit.load(model_file, _extra_files=extra)
        spec = json.loads(extra[COMPILED_SPEC])
        nc = self.neuron_config
        if (nc.world_size, nc.tp_degree) != (spec["world_size"], spec["tp_degree"]):
            raise RuntimeError(f"neuron_config.json says world_size {nc.world_size} / tp {nc.tp_degree}, model.pt was "
                               f"compiled for {spec['world_size']} / {spec['tp_degree']}")
        compiled, given = spec["graph_config"], graph_config(self.config)
        for key in compiled:
            if compiled[key] != given[key]:
                # Stricter than NxDI, which runs the graphs with whatever config loads them and reads their outputs by
                # that config: tokens read as logits, or a call of the wrong inputs.
                raise RuntimeError(f"model.pt was compiled with {key}={compiled[key]!r} and is loaded with a config "
                                   f"that says {given[key]!r}")
        start = 0 if start_rank_id is None else start_rank_id
        count = nc.local_ranks_size if local_ranks_size is None else local_ranks_size
        weights = {name: Weight.from_json(doc) for name, doc in spec["weights"].items()}
        if not nc.save_sharded_checkpoint:
            raise DoubleRefusal("load() would shard the HF checkpoint now (save_sharded_checkpoint=False: "
                                "\"Sharding weights on load...\"); the double reads only weights/")
        from safetensors.torch import load_file

        ranks = list(range(start, start + count))
        files, shards = [], []
        for rank in ranks:                 # skip_sharding is not consulted here (section 2)
            shard = os.path.join(path, "weights", f"tp{rank}_sharded_checkpoint.safetensors")
            if not os.path.isfile(shard):
                raise FileNotFoundError(f"{shard}: no such shard")
            files.append(os.path.basename(shard))
            shards.append(load_file(shard))
            _check_shard(files[-1], rank, nc.tp_degree, weights, shards[-1])
        unstated = self._check_values(files, ranks, shards, weights)
        # The inputs each submodel's graphs were traced with (what the port's trace returned), for a call to check.
        self.traced_inputs = {neff["tag"]: neff["traced"].get("inputs") for neff in spec["neffs"]}
        self.is_loaded = True
        record("load", cls=type(self).__name__, path=path, ranks=ranks, skip_warmup=skip_warmup,
               weights=len(weights), values_checked=True, values_unstated=unstated)

    def _check_values(self, files: list[str], ranks: list[int], shards: list[dict],
                      weights: dict[str, Weight]) -> list[str]:
        """Every float tensor of every rank against what NxD would hold there, derived by the double from the HF
        checkpoint the bundle was built from (neuronx_distributed_inference._values, written from docs/nxd-layout.md
        and docs/nxdi.md). nxd_model.initialize takes any values; a swapped or mis-padded slice would load and compute
        garbage, and the double's verify runs at thresholds of 0, so this is where such a bundle must fail. The HF
        checkpoint is named by the double's settings (tests.nxdi_double.settings_dir(checkpoint=...))."""
        from neuronx_distributed_inference import _values

        checkpoint = settings().get("checkpoint")
        if not checkpoint:
            raise DoubleRefusal("load() checks every shard's values against the HF checkpoint the bundle was built "
                                "from, and the double's settings name none (settings_dir(checkpoint=...))")
        hf = _values.HFCheckpoint(Path(checkpoint))
        layout = _values.Layout.of(self._model_cls.LINEAGE, self.config)
        expected = [{**_values.expected_rank(hf, layout, rank), **_values.zero_weights(weights)} for rank in ranks]
        for file, rank, tensors, exp in zip(files, ranks, shards, expected):
            _values.check_rank(file, rank, tensors, exp)
        return _values.check_unstated(files, shards, expected)

    def reset(self) -> None:
        """Called by HuggingFaceGenerationAdapter.generate before every generation (hf_adapter.py)."""


def graph_config(config) -> dict:
    """What the traced graphs were built for beyond their buckets and weights, which the config that loads them must
    say alike: on-device sampling ends every graph in the sampler, whose token is its first output instead of the
    logits (models/model_base.py L1001-1008 @ ef2731e), output_logits adds the logits as a second output (L1018-1024),
    and the main ports' context encoding takes image features only where use_text_only_cte_inputs is False (their
    Qwen35ModelWrapper.input_generator, 2B modeling_qwen35.py L6804-6840 @ 4bcdc54)."""
    nc = config.neuron_config
    return {"on_device_sampling_config": to_dict(nc.on_device_sampling_config), "output_logits": nc.output_logits,
            "use_text_only_cte_inputs": getattr(config, "use_text_only_cte_inputs", None)}


def _refuse_repeated_options(args: str) -> None:
    """neuronx-cc's behaviour when an option is given twice (`--auto-cast=none ... --auto-cast matmult`) is stated by
    no public source, so the double refuses such arguments rather than guess which value wins (docs/nxdi.md
    section 7). `--x=v` and `--x v` name the same option; `-O1` is `-O`."""
    seen: dict[str, str] = {}
    for token in shlex.split(args):
        if not token.startswith("-"):
            continue
        name = "-O" if re.fullmatch(r"-O\d", token) else token.split("=", 1)[0]
        if name in seen:
            raise DoubleRefusal(f"compiler arguments give {name} twice ({seen[name]!r} and {token!r}): which one "
                                "neuronx-cc takes is not in any public source")
        seen[name] = token


class _CompiledModel(torch.nn.Module):
    def forward(self, x):
        return x * 1


def _check_shard(file: str, rank: int, tp: int, weights: dict[str, Weight], tensors: dict) -> None:
    """What nxd_model.initialize needs from one rank's shard: every weight the compiled model takes, in its per-rank
    shape. The double also rejects extra tensors, other dtypes and wrong rank-tensor values (the facts do not say
    whether initialize checks them; a shard with any of them is wrong for the model)."""
    for name in sorted(set(weights) | set(tensors)):
        w, t = weights.get(name), tensors.get(name)
        if t is None:
            raise RuntimeError(f"{file}: {name}: the compiled model takes it (shape {list(w.shape)}) and the shard "
                               "has no such tensor")
        if w is None:
            raise RuntimeError(f"{file}: {name}: the shard holds it and the compiled model takes no such weight")
        if tuple(t.shape) != w.shape:
            raise RuntimeError(f"{file}: {name}: shape {list(t.shape)}, the compiled model takes {list(w.shape)}")
        if _dtype_name(t.dtype) != w.dtype:
            raise RuntimeError(f"{file}: {name}: dtype {_dtype_name(t.dtype)}, the compiled model takes {w.dtype}")
        if w.value is not None and t.tolist() != rank_value(w, rank, tp):
            raise RuntimeError(f"{file}: {name}: value {t.tolist()}, rank {rank} needs {rank_value(w, rank, tp)}")
