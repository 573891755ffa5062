"""How the steps whose outputs hold computed floats (reference logits, verify's measures) compute them.

A matrix product's sums are split by thread, so their last bits follow the thread count: such a step uses this many
threads on every host, whatever its cores or its executor (a Ray worker gets OMP_NUM_THREADS=1), so that one key
names one set of bytes wherever it is built. It is in those steps' code: changing it changes their keys.
"""

from __future__ import annotations

NUMERIC_THREADS = 4


def fix_threads() -> None:
    import torch

    torch.set_num_threads(NUMERIC_THREADS)
