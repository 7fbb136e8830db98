"""Vocabulary projections of a few rows on a CPU, in the orientation MKL runs fastest.

A decoding round projects a handful of final hidden states onto a wide vocabulary: the target's
262k x 640 LM head for the rows a verification reads, the draft head's 16k x 640 head for its D
read-out rows. As `rows x weight^T` (what `nn.Linear` computes) MKL runs such a product slower
than the same product as `weight x rows^T` on an AVX2 CPU in float32, for a few rows (1 row and
100+ rows about equal; docs/benchmarks.md has the figures). `python -m jobs.bench verify_shapes`
prints both ways side by side.

Which orientation runs is the `projection` strategy of `dart_worker.hardware.kernels` (weight-first for
float32 on a CPU: that is where it was measured; a GPU and bf16 CPUs (AMX, oneDNN) keep the
module's own product); training (autograd, autocast) and biased layers always keep the module's.

MKL's `weight x rows^T` rounds differently by the weight's address alignment (not the rows'):
the same weight at another offset of a buffer can differ in the last bit. Weights torch allocates
are 64-byte aligned; loaders that hand out views into a file buffer copy them
(`draft_checkpoint.load_draft_head`), so a loaded head computes exactly what the saved one did.
"""

from __future__ import annotations

import torch
from torch import nn

from dart_worker.hardware.kernels import projection_for


def project(hidden: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """`linear(hidden)` for hidden [..., in] -> [..., out], exactly the same product.

    The rows are flattened into one contiguous [rows, in] matrix first: a strided view (say
    every sequence's root row, `hidden[:, :1]`) would otherwise be multiplied as a batch of
    separate products, each reading the whole weight (16 sequences: 16 reads of it, not one).
    """
    rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    out = (linear.weight @ rows.t()).t().contiguous() if _weight_first(rows, linear) else linear(rows)
    return out.reshape(*hidden.shape[:-1], out.shape[-1])


def _weight_first(rows: torch.Tensor, linear: nn.Module) -> bool:
    """The weight-first product where the strategy asks for it and it is the same product: one
    bias-free `nn.Linear` of the rows' dtype and device, inference, several rows (one row is a
    matrix-vector product either way). A weight elsewhere (offloaded by accelerate, which loads it
    in the module's forward) keeps the module's own product."""
    return (rows.shape[0] > 1 and type(linear) is nn.Linear and linear.bias is None
            and linear.weight.dtype == rows.dtype and linear.weight.device == rows.device
            and not torch.is_grad_enabled()
            and projection_for(rows.device, rows.dtype) == "weight_first")
