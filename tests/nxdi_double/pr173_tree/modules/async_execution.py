"""Fake of NxDI PR 173's src/neuronx_distributed_inference/modules/async_execution.py (@ 03db3ef): the four functions
the Qwen3.6-27B port imports from it (modeling_qwen35.py L47-52), which only that tree has (not NxDI main @ 4bcdc54,
nor the 2.29 code base @ ef2731e). tests.nxdi_double.nxdi_tree() lays it into a copy of the double's NxDI. The double
never runs a request through them."""


def prepare_hybrid_apc_request_for_execution(*args, **kwargs):     # L1429
    raise NotImplementedError("the NxDI double does not run hybrid APC requests")


def finish_hybrid_apc_request(input_dict):                           # L1777
    raise NotImplementedError("the NxDI double does not run hybrid APC requests")


def cancel_hybrid_apc_request(input_dict):                           # L1818
    raise NotImplementedError("the NxDI double does not run hybrid APC requests")


def prepare_hybrid_apc_model_inputs(*args, **kwargs):              # L1899
    raise NotImplementedError("the NxDI double does not run hybrid APC requests")
