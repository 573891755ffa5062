"""Contract double of torch-neuronx: `trace`, as the ports' compile_vision_encoder.py calls it (docs/nxdi.md section
5; contrib/models/Qwen3.5-35B-A3B/test/integration/compile_vision_encoder.py @ 4bcdc54):

    torch_neuronx.trace(cpu_model, (hidden_states, attention_mask, cos, sin),
                        compiler_workdir=..., compiler_args=[...])

The double records the call and returns `torch.jit.trace(func, example_inputs)`, which torch.jit.save accepts as the
real traced module would. Keyword arguments beyond the recorded ones are refused (stricter than the real signature,
which the facts do not list).
"""

from __future__ import annotations

import os
import warnings

import torch

from neuronx_distributed_inference._double import record


def trace(func, example_inputs, *args, compiler_workdir=None, compiler_args=None, inline_weights_to_neff=True):
    if args:
        raise TypeError("torch_neuronx.trace: only (func, example_inputs) are positional")
    if not isinstance(example_inputs, tuple) or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        raise TypeError("torch_neuronx.trace: example_inputs must be a tuple of tensors")
    if compiler_args is not None and not (isinstance(compiler_args, str) or
                                          all(isinstance(a, str) for a in compiler_args)):
        raise TypeError("torch_neuronx.trace: compiler_args must be a string or a list of strings")
    params = list(func.named_parameters()) if isinstance(func, torch.nn.Module) else []
    record("torch_neuronx.trace", module=f"{type(func).__module__}.{type(func).__name__}",
           compiler_workdir=compiler_workdir, compiler_args=compiler_args,
           inline_weights_to_neff=inline_weights_to_neff,
           example_inputs=[{"shape": list(t.shape), "dtype": str(t.dtype).split(".")[1]} for t in example_inputs],
           parameters=len(params), parameter_dtypes=sorted({str(p.dtype).split(".")[1] for _, p in params}))
    if compiler_workdir is not None:
        os.makedirs(compiler_workdir, exist_ok=True)
        with open(os.path.join(compiler_workdir, "graph.neff"), "wb") as f:
            f.write(b"nxdi-double vision neff\n")
    with torch.no_grad(), warnings.catch_warnings():   # torch marks torch.jit deprecated; the ports still use it
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.trace(func, example_inputs)
