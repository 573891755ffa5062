"""Contract double of neuronx_distributed/trace/trace.py @ fbac349, the parts the ports' TP vision encoder uses:

- parallel_model_trace(func, example_inputs, ..., compiler_workdir, compiler_args, ..., tp_degree) (L242-256): `func`
  returns (model, input_output_alias) for the current rank (L212); NxD runs it in spawned processes, one per rank
  (L345-361), so it must be a picklable, module-level callable, and the double checks that it pickles. Each rank's
  model is traced; the result holds one traced module per rank.
- parallel_model_save(model, save_dir) writes `save_dir/tp_<rank>.pt` per rank (L372-380).
- parallel_model_load(model_dir) reads every file of model_dir as `tp_<rank>.pt`, ranks in order; another file fails
  (its name parsed as a rank: L390-409).
- get_sharded_checkpoint(checkpoint, model, rank, tp_degree) drops the checkpoint's keys the model lacks, then slices
  each tensor of a parallel layer for `rank` on its partition_dim (L640-656, create_local_weight).

Each trace is recorded (call "parallel_model_trace") with its arguments and every rank's parameter shapes.
"""

from __future__ import annotations

import os
import pickle
import warnings

import torch

from neuronx_distributed.parallel_layers.parallel_state import building
from neuronx_distributed_inference._double import record


class TensorParallelNeuronModel(torch.nn.Module):
    def __init__(self, models: list):
        super().__init__()
        self.models = models

    def forward(self, *args):
        return self.models[0](*args)


def parallel_model_trace(func, example_inputs, states=None, compiler_workdir=None, compiler_args=None,
                         inline_weights_to_neff=True, bucket_config=None, tp_degree=1, max_parallel_compilations=None,
                         spmd_mode=False, checkpoint_loader_callable=None, force_custom_init_on_device=False,
                         serialization_path=None):
    if spmd_mode or bucket_config is not None or not inline_weights_to_neff:
        raise NotImplementedError("the double traces the ports' way only: inlined weights, no SPMD, no buckets")
    pickle.dumps(func)   # NxD hands it to spawned rank processes (L345-361)
    models, ranks = [], []
    for rank in range(tp_degree):
        with building(rank, tp_degree):
            model, alias = func()
        if not isinstance(alias, dict):
            raise TypeError("parallel_model_trace: func must return (model, input_output_alias)")
        ranks.append({name: {"shape": list(p.shape), "dtype": str(p.dtype).split(".")[1]}
                      for name, p in model.named_parameters()})
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            models.append(torch.jit.trace(model, example_inputs))
    record("parallel_model_trace", func=f"{func.__module__}.{func.__qualname__}", tp_degree=tp_degree,
           module=f"{type(model).__module__}.{type(model).__name__}", compiler_workdir=compiler_workdir,
           compiler_args=compiler_args, example_inputs=_shapes(example_inputs), ranks=ranks)
    if compiler_workdir is not None:
        for rank in range(tp_degree):
            os.makedirs(os.path.join(compiler_workdir, f"_tp{rank}"), exist_ok=True)
            with open(os.path.join(compiler_workdir, f"_tp{rank}", "graph.neff"), "wb") as f:
                f.write(b"nxdi-double tp vision neff\n")
    return TensorParallelNeuronModel(models)


def _shapes(inputs):
    if isinstance(inputs, torch.Tensor):
        return {"shape": list(inputs.shape), "dtype": str(inputs.dtype).split(".")[1]}
    return [_shapes(x) for x in inputs]


def parallel_model_save(model: TensorParallelNeuronModel, save_dir: str) -> None:
    os.makedirs(save_dir, exist_ok=True)
    for rank, traced in enumerate(model.models):
        torch.jit.save(traced, os.path.join(save_dir, f"tp_{rank}.pt"))


def parallel_model_load(model_dir: str) -> TensorParallelNeuronModel:
    names = sorted(os.listdir(model_dir), key=lambda x: int(x.replace(".pt", "").replace("tp_", "")))
    if names != [f"tp_{rank}.pt" for rank in range(len(names))]:
        raise ValueError(f"{model_dir}: {names} are not tp_0.pt .. tp_{len(names) - 1}.pt")
    return TensorParallelNeuronModel([torch.jit.load(os.path.join(model_dir, n)) for n in names])


def get_sharded_checkpoint(checkpoint, model, rank, tp_degree, is_cached=False):
    params = dict(model.named_parameters())
    for key in [k for k in checkpoint if k not in model.state_dict()]:
        checkpoint.pop(key)
    for name, param in params.items():
        dim = getattr(param, "partition_dim", None)
        if dim is None or name not in checkpoint:
            continue
        full = checkpoint[name]
        checkpoint[name] = full.chunk(tp_degree, dim=dim)[rank].contiguous()
