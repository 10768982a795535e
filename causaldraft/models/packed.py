"""The LM head through oneDNN with its weight reordered once ("packed"), for bfloat16 activations.

The LM head is the widest product of a pass ([rows, hidden] x [hidden, vocab]: 49152 x 576 for
the default model) and it runs outside the compiled graphs. Measured on this CPU (torch 2.13,
2 threads), milliseconds per call by rows:

    rows                          1     4     8     16    32
    int8 kernel (_weight_int8pack_mm)     3.5   4.0   9.1   19.0  37.8
    bf16 F.linear                 6.0   6.7   7.5   10.4  14.1
    bf16 packed (this module)     3.1   2.5   3.9   5.8   9.8

so the packed head is the fastest at every row count, for a one-row plain step and for the many
rows of a draft tree or a batch alike. Quantized models (int8, int4) use it too: their LM head is
then the checkpoint's matrix in bf16 (56 MB for the default model against 28 MB in int8), which is
also closer to the checkpoint than an int8 requantization.

Row invariance (docs/exactness.md): every pass must compute each row bit for bit as a one-row pass
would. oneDNN's one-row product rounds differently from its products of more rows for some shapes
(measured: in_features 1536, data-dependent), while calls of 2 to 64 rows agree row for row with
each other whatever the other rows hold (measured for in_features 576, 960, 1536 and 2048). So the
module never makes a call of fewer than ``MIN_ROWS_PER_CALL`` rows (a shorter input is padded
with zero rows; 4 rows also cost less than 1 here) nor more than ``MAX_ROWS_PER_CALL``, and it
checks this on seeded random rows for the actual weight when it is made; a weight that fails the
check keeps the plain linear (``packed_head`` returns None).
"""

from __future__ import annotations

import torch
from torch import nn

from causaldraft.models.native import NativeLlama

MAX_ROWS_PER_CALL = 32  # rows of one oneDNN call (longer inputs are split)
MIN_ROWS_PER_CALL = 4  # shorter calls are padded with zero rows
CHECKED_ROW_COUNTS = (4, 5, 8, 16, 17, 31, 32)  # call sizes compared row for row when a head is made
CHECK_SEED = 0


def packed_available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """The weight [out, in] reordered for oneDNN's linear (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)


def packed_product(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """rows [m, in] @ W.T -> [m, out] through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [None], "")


def padded_product(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """rows [m, in] @ W.T -> [m, out] in calls of MIN..MAX_ROWS_PER_CALL rows.

    Example: 37 rows run as calls of 32 and 5 rows; 2 rows run as one call of 4 (2 zero rows)."""
    parts = []
    for part in rows.split(MAX_ROWS_PER_CALL):
        count = part.shape[0]
        if count < MIN_ROWS_PER_CALL:
            part = torch.cat([part, part.new_zeros(MIN_ROWS_PER_CALL - count, part.shape[1])])
        parts.append(packed_product(part, packed)[:count])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def rows_agree(packed: torch.Tensor, in_features: int, dtype: torch.dtype) -> bool:
    """Whether calls of every size in CHECKED_ROW_COUNTS give each row bit for bit as a call with
    that row alone (padded), on seeded random rows."""
    generator = torch.Generator().manual_seed(CHECK_SEED)
    rows = torch.randn(MAX_ROWS_PER_CALL, in_features, generator=generator).to(dtype)  # [32, in]
    alone = torch.cat([padded_product(rows[i : i + 1], packed) for i in range(MAX_ROWS_PER_CALL)])
    return all(torch.equal(packed_product(rows[:count], packed), alone[:count]) for count in CHECKED_ROW_COUNTS)


class PackedLinear(nn.Module):
    """``y = x @ weight.T`` (no bias) for bfloat16 ``x`` in oneDNN calls of 4 to 32 rows, so each
    row is computed bit for bit alike whatever the call's other rows (see the module docstring).

    ``weight`` stays the module's parameter (``lm_head.weight``, what drafters and graphs read);
    ``packed`` is its oneDNN reordering, a plain attribute (not a buffer: it is derived, opaque,
    and no graph or state dict takes it).
    """

    def __init__(self, weight: nn.Parameter, packed: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [m, in]
        return padded_product(rows, self.packed).reshape(*x.shape[:-1], self.out_features)


def packed_head(weight: nn.Parameter) -> PackedLinear | None:
    """A PackedLinear over ``weight`` [vocab, hidden] (bf16), or None where oneDNN is missing or
    its products are not row-invariant for this weight."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not packed_available():
        return None
    packed = pack(weight, MAX_ROWS_PER_CALL)
    if not rows_agree(packed, weight.shape[1], weight.dtype):
        return None
    return PackedLinear(weight, packed)


def use_packed_head(model: NativeLlama) -> bool:
    """Replace ``model.lm_head`` (a bf16 linear without bias) by its PackedLinear; False (nothing
    changed) where that is not possible."""
    linear = model.lm_head
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        return False
    head = packed_head(linear.weight)
    if head is None:
        return False
    model.lm_head = head
    return True
