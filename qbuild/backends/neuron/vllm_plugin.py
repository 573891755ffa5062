"""The vLLM general plugin a neuron bundle carries (copied to <bundle>/vllm/qbuild_vllm_plugin.py by the package step,
beside qbuild_vllm_plugin.json, which names what to register, and a *.dist-info that declares the entry point).

vllm-neuron finds the model class in NxDI's MODEL_TYPES registry under the name it derives from the config's
architecture (_get_neuron_model_cls, vllm_neuron/worker/neuronx_distributed_model_loader.py L925-982 @ 3afb0a9), and
NxDI has no entry for these models; vLLM itself must know the HF config class and the architecture before the plugin's
loader runs. The ports do that by hand: Coder-Next imports a register_model.py (vllm/register_model.py L20-26, PR 170
@ 753c7f5), the Qwen3.6-27B port patches NxDI's constants.py in site-packages and registers its HF config from a
sitecustomize.py (vllm/patch_nxdi_registry.py L23-32, vllm/sitecustomize.py L10-12, vllm/hf_qwen35_config.py L13-63,
PR 173 @ 03db3ef). Here the bundle registers the same three things itself, as a vLLM general plugin: vLLM loads those
in every process it starts (vllm/plugins/__init__.py L12-14, L68-81 @ vLLM 0.16.0), before it reads the config
(EngineArgs, vllm/engine/arg_utils.py L612-614) and again in the engine-core process (vllm/v1/engine/core.py L91-93),
from the `vllm.general_plugins` entry points of every distribution on sys.path, filtered by VLLM_PLUGINS (L28-65).
So PYTHONPATH=<bundle>/vllm and the plugin's name in VLLM_PLUGINS are all a host needs: nothing is written to
site-packages, and a copied bundle serves the same way. A bundle with chunked prefill also has the plugin install the
port's own vLLM patch from the bundle's copy of the port (install_serving_patch).

vllm-neuron 0.5 starts vLLM's engine core with the `spawn` method (vllm_neuron/platform.py L7 @ 3afb0a9), so the
engine's configuration, the HF config object with it, is pickled into a new interpreter (vllm/v1/engine/utils.py
L99-128 @ vLLM 0.16.0). Pickle names a class by module and name, so every config class here lives at module level; the
new interpreter imports this module from the same PYTHONPATH before the plugin runs there.

This file runs inside vLLM's interpreter, without qbuild: the standard library, transformers, and what vLLM brings.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from transformers import AutoConfig, PretrainedConfig

SPEC = "qbuild_vllm_plugin.json"
_HERE = os.path.dirname(os.path.abspath(__file__))
# What vLLM's registry is given for an architecture it does not know: a class it can inspect. The Neuron plugin runs
# the model through NxDI, never through this class (the Qwen3.6-27B port registers the same:
# vllm/hf_qwen35_config.py L53-63 @ 03db3ef). A text class, for VL bundles too: vllm-neuron 0.5 cannot run these
# models' images, and with a text class vLLM refuses an image part with a 400 (docs/vllm.md section 11).
STAND_IN = "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"


# --- the HF config classes (for a transformers without the Qwen3.5 model types) ----------------------------------
# vLLM 0.16 requires transformers >= 4.56, < 5 (its METADATA; the SDK's release content says the same:
# release-notes/prev/content.rst L67-78 @ aws-neuron-sdk a3247f5), and 4.57 knows qwen3_next but none of the Qwen3.5
# types (transformers/models/auto/configuration_auto.py @ 4.57.6). PR 173 registers such permissive classes
# (vllm/hf_qwen35_config.py L13-35 @ 03db3ef); the bundle's config.json already carries the text fields at its top
# level (package.flat_config), so these only turn text_config into a config object, as vLLM's get_text_config() and
# vllm-neuron (loader L72-76 @ 3afb0a9) expect.

class Qwen35TextConfig(PretrainedConfig):
    model_type = "qwen3_5_text"


class Qwen35MoeTextConfig(PretrainedConfig):
    model_type = "qwen3_5_moe_text"


class _WithTextConfig(PretrainedConfig):
    text_class: type = PretrainedConfig

    def __init__(self, text_config=None, **kwargs):
        super().__init__(**kwargs)
        if isinstance(text_config, dict):
            text_config = self.text_class(**text_config)
        self.text_config = text_config


# Each class names its own __init__: transformers 5 turns a config subclass without one into a dataclass with a
# generated __init__ (PreTrainedConfig.__init_subclass__), which would keep text_config a dict.
class Qwen35Config(_WithTextConfig):
    model_type = "qwen3_5"
    text_class = Qwen35TextConfig
    sub_configs = {"text_config": Qwen35TextConfig}
    __init__ = _WithTextConfig.__init__


class Qwen35MoeConfig(_WithTextConfig):
    model_type = "qwen3_5_moe"
    text_class = Qwen35MoeTextConfig
    sub_configs = {"text_config": Qwen35MoeTextConfig}
    __init__ = _WithTextConfig.__init__


CONFIG_CLASSES: dict[str, type] = {c.model_type: c for c in (Qwen35TextConfig, Qwen35MoeTextConfig, Qwen35Config,
                                                              Qwen35MoeConfig)}


# --- the app class: load the bundle, never compile into it -------------------------------------------------------

class PrecompiledOnly:
    """Mixed in front of the port's app class in MODEL_TYPES. Where `App(path).load(path)` raises FileNotFoundError or
    ValueError, vllm-neuron compiles the model again into NEURON_COMPILED_ARTIFACTS, the bundle itself
    (_load_weights_common L210-219, load_weights L560-571, _compile_and_load_model L263-271 @ 3afb0a9; the same at
    a5ef7c8 L185-194, L390-395), after writing a quantized checkpoint into the model directory where the config is
    quantized (L268-269). Here both refuse, naming the load's failure, so a bundle is served as it was built or not
    at all."""

    load_error: str | None = None

    def load(self, *args, **kwargs):
        try:
            return super().load(*args, **kwargs)
        except Exception as e:
            type(self).load_error = f"{type(e).__name__}: {e}"
            raise

    def compile(self, compiled_model_path, *args, **kwargs):
        raise RuntimeError(_refusal(f"compile into {compiled_model_path}", type(self).load_error))

    @classmethod
    def save_quantized_state_dict(cls, model_path, *args, **kwargs):
        raise RuntimeError(_refusal(f"write a quantized checkpoint into {model_path}", cls.load_error))


def _refusal(what: str, load_error: str | None) -> str:
    return (f"qbuild bundle: the precompiled model did not load ({load_error or 'no load was tried'}); vllm-neuron "
            f"would now {what} as its fallback, which a qbuild bundle refuses: serve it as it was built (see the "
            "load's error above), or build it again")


def guarded(app: type) -> type:
    """`app` with PrecompiledOnly in front, one class per app, kept at module level under its name. MODEL_TYPES holds
    it in each process (never pickled): this process's plugin call made it."""
    name = f"PrecompiledOnly{app.__name__}"
    cls = globals().get(name)
    if cls is None or cls.__mro__[1] is not PrecompiledOnly or cls.__mro__[2] is not app:
        cls = type(name, (PrecompiledOnly, app), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls
    return cls


# --- registration --------------------------------------------------------------------------------------------------

def register() -> None:
    """The entry point: put the bundle's port on sys.path and register the config, the architecture and the model
    class. vLLM calls it once per process; calling it again changes nothing."""
    spec = load_spec()
    add_port_to_path(spec)
    register_hf_config(spec)
    register_architecture(spec)
    register_nxdi_model(spec)
    install_serving_patch(spec)


def load_spec() -> dict:
    with open(os.path.join(_HERE, SPEC)) as f:
        return json.load(f)


def add_port_to_path(spec: dict) -> None:
    """The bundle's copy of the port, so that the app class imports from it wherever the bundle lies."""
    port = os.path.normpath(os.path.join(_HERE, spec["port_dir"]))
    if port not in sys.path:
        sys.path.insert(0, port)


def _known(model_type: str) -> bool:
    try:
        AutoConfig.for_model(model_type)
    except ValueError:
        return False
    return True


def register_hf_config(spec: dict) -> None:
    """This module's class for the bundle's model type (and its text model's) where the installed transformers has
    none; RuntimeError where neither has one."""
    for model_type in (spec.get("text_model_type"), spec["model_type"]):
        if model_type is None or _known(model_type):
            continue
        if model_type not in CONFIG_CLASSES:
            raise RuntimeError(f"qbuild bundle: transformers here has no config class for model_type {model_type!r} "
                               f"and the bundle's plugin has none either ({', '.join(CONFIG_CLASSES)})")
        AutoConfig.register(model_type, CONFIG_CLASSES[model_type])


def register_architecture(spec: dict) -> None:
    from vllm.model_executor.models import ModelRegistry

    if spec["architecture"] not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(spec["architecture"], STAND_IN)


def register_nxdi_model(spec: dict) -> None:
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    app = getattr(importlib.import_module(spec["module"]), spec["app_class"])
    MODEL_TYPES.setdefault(spec["nxdi_model"], {})[spec["nxdi_task"]] = guarded(app)


# --- the port's own vLLM patch (a bundle with chunked prefill) ---------------------------------------------------

def install_serving_patch(spec: dict) -> None:
    """Install the vLLM patch of the bundle's port where the spec names one (a long-context bundle), as the Qwen3.6-27B
    port's launcher does for chunked prefill and hybrid APC (vllm/start_vllm_server.sh L138-140 with
    vllm/sitecustomize.py L14-23, and vllm/serve_qwen36.py L8-16, PR 173 @ 03db3ef). The patch itself wraps vLLM's
    scheduler and KV cache manager and vllm-neuron's runner and loader in this process through an import hook
    (its install_import_hook, vllm/qwen36_hybrid_apc_scheduler_patch.py L2737-2749), among them vllm-neuron 0.5's KV
    cache spec, which lists every layer as attention (neuronx_distributed_model_runner.py L892-917 @ 3afb0a9): the
    patch lists the hybrid model's attention layers only (L2352-2411). It is loaded from the bundle's copy of the
    port by its path, under its own module name, and nothing on disk changes."""
    patch = spec.get("serving_patch")
    if not patch:
        return
    path = os.path.normpath(os.path.join(_HERE, patch["file"]))
    name = os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(name)
    if module is None:
        import importlib.util

        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None:
            raise RuntimeError(f"qbuild bundle: the port's vLLM patch {path} does not load")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        loader_spec.loader.exec_module(module)
    getattr(module, patch["install"])()
