"""The vLLM general plugin a neuron bundle carries (copied to <bundle>/vllm/qbuild_vllm_plugin.py by the package step,
beside qbuild_vllm_plugin.json, which names what to register, and a *.dist-info that declares the entry point).

vllm-neuron finds the model class in NxDI's MODEL_TYPES registry under the name it derives from the config's
architecture (vllm_neuron/worker/neuronx_distributed_model_loader.py L639-659 @ a5ef7c8), and NxDI has no entry for
these models; vLLM itself must know the HF config class and the architecture before the plugin's loader runs. The
ports do that by hand: Coder-Next imports a register_model.py (vllm/register_model.py L20-26, PR 170 @ 753c7f5), the
Qwen3.6-27B port patches NxDI's constants.py in site-packages and registers its HF config from a sitecustomize.py
(vllm/patch_nxdi_registry.py L23-32, vllm/sitecustomize.py L10-12, vllm/hf_qwen35_config.py L13-63, PR 173 @ 03db3ef).
Here the bundle registers the same three things itself, as a vLLM general plugin: vLLM loads those in every process
it starts, before it reads the config (EngineArgs.__post_init__, vllm/engine/arg_utils.py @ 99d7eb5), from the
`vllm.general_plugins` entry points of every distribution on sys.path, filtered by VLLM_PLUGINS
(vllm/plugins/__init__.py L19-58 @ 0142555). So PYTHONPATH=<bundle>/vllm and the plugin's name in VLLM_PLUGINS are
all a host needs: nothing is written to site-packages, and a copied bundle serves the same way.

This file runs inside vLLM's interpreter, without qbuild: the standard library only, and what vLLM brings.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

SPEC = "qbuild_vllm_plugin.json"
_HERE = os.path.dirname(os.path.abspath(__file__))
# What vLLM's registry is given for an architecture it does not know: a class it can inspect. The Neuron plugin runs
# the model through NxDI, never through this class (the Qwen3.6-27B port registers the same:
# vllm/hf_qwen35_config.py L53-63 @ 03db3ef).
STAND_IN = "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"


def register() -> None:
    """The entry point: put the bundle's port on sys.path and register the config, the architecture and the model
    class. vLLM calls it once per process; calling it again changes nothing."""
    spec = load_spec()
    add_port_to_path(spec)
    register_hf_config(spec)
    register_architecture(spec)
    register_nxdi_model(spec)


def load_spec() -> dict:
    with open(os.path.join(_HERE, SPEC)) as f:
        return json.load(f)


def add_port_to_path(spec: dict) -> None:
    """The bundle's copy of the port, so that the app class imports from it wherever the bundle lies."""
    port = os.path.normpath(os.path.join(_HERE, spec["port_dir"]))
    if port not in sys.path:
        sys.path.insert(0, port)


def register_hf_config(spec: dict) -> None:
    """A permissive config class for the bundle's model_type where the installed transformers has none. The bundle's
    config.json already carries the text fields at its top level; text_config becomes a config object, as vLLM's
    get_text_config() and vllm-neuron (loader L63-66 @ a5ef7c8) expect of a config with one."""
    from transformers import AutoConfig, PretrainedConfig

    model_type, text_type = spec["model_type"], spec.get("text_model_type")
    try:
        AutoConfig.for_model(model_type)
        return
    except ValueError:
        pass
    text_cls = type("QbuildBundleTextConfig", (PretrainedConfig,), {"model_type": text_type or f"{model_type}_text"})

    def __init__(self, text_config=None, **kwargs):
        if isinstance(text_config, dict):
            text_config = text_cls(**text_config)
        self.text_config = text_config
        PretrainedConfig.__init__(self, **kwargs)

    attrs = {"model_type": model_type, "__init__": __init__}
    if text_type:
        attrs["sub_configs"] = {"text_config": text_cls}
    AutoConfig.register(model_type, type("QbuildBundleConfig", (PretrainedConfig,), attrs))


def register_architecture(spec: dict) -> None:
    from vllm.model_executor.models import ModelRegistry

    if spec["architecture"] not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(spec["architecture"], STAND_IN)


def register_nxdi_model(spec: dict) -> None:
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    app = getattr(importlib.import_module(spec["module"]), spec["app_class"])
    MODEL_TYPES.setdefault(spec["nxdi_model"], {})[spec["nxdi_task"]] = app
