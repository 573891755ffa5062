"""Fake of the port's src/nki_deltanet.py: modeling_qwen35_moe.py imports it FLAT (`from nki_deltanet import
deltanet_recurrent_fwd`, l.50), so the port's src/ directory must be on sys.path (docs/nxdi.md section 15)."""


def deltanet_recurrent_fwd(*args, **kwargs):
    raise NotImplementedError("the contract double does not run NKI kernels")


def deltanet_recurrent_fwd_state(*args, **kwargs):
    raise NotImplementedError("the contract double does not run NKI kernels")
