"""The row counts a CPU step's GEMMs run at, where oneDNN runs them (the lean decoder pads to these)."""

from __future__ import annotations

import torch


def padded_tokens(t: int, multiple: int) -> int:
    """The row count a CPU step's GEMMs run at: up to 32 as it is, above that the next multiple of
    `multiple`. oneDNN builds (and JIT-compiles) a kernel for every new row count, 1-14 ms per
    weight shape, while a step's chunked prefills make nearly every count new; the decoder's
    warm-up compiles each padded count once, and the pad rows cost less than a compile."""
    return t if t <= 32 else -(-t // multiple) * multiple


# Row multiples the steps pad to where oneDNN runs the GEMMs. fp32 GEMMs here are compute-bound,
# their time linear in the rows: the finer, the less padding is computed (fp32 pads only where
# neither the project's GEMM nor MKL runs them). AMX runs bf16 tiles of 16 rows and is
# slower at 8-row multiples between them (`orcaserve-bench kernels gemm --rows 136,144,264,288`).
PAD_MULTIPLE = {torch.float32: 8, torch.bfloat16: 16}
