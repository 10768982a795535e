"""The products of one decoding pass, by rows: the linears of every layer in pass order (each reads its
weights from memory, as in a pass) and the LM head, median ms (docs/int4-kernel.md).

int4 (the default): the int4 kernel loading picks for this CPU; ``CAUSALDRAFT_INT4_KERNEL=torch`` (or a
build's name) runs another, for a comparison in a second process (on a busy or drifting machine, compare
runs made back to back, and rerun).

``--dtype bfloat16``: the layers' bf16 linears as loading makes them (causaldraft's ``bf16_mm`` where it is
built) and, in the same process, interleaved, the same weights through oneDNN reordered once, what bf16
graphs run where the kernel is not built (their weights frozen in).

    .venv/bin/python bench/kernel_speed.py
    CAUSALDRAFT_INT4_KERNEL=torch .venv/bin/python bench/kernel_speed.py
    .venv/bin/python bench/kernel_speed.py --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch
from pass_cost import median_ms  # bench/: the script's own directory
from torch import nn

from causaldraft.models.loading import load_model
from causaldraft.models.native import NativeLlama
from causaldraft.models.packed import MIN_ROWS_PER_CALL, pack, packed_product
from causaldraft.models.quant import Bf16BlockLinear, Int4Linear, Int8Linear, int4_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", default="1,2,3,4,8,16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", choices=("int4", "bfloat16"), default="int4")
    args = parser.parse_args()
    if args.dtype == "bfloat16":
        bf16_products(args.model, [int(value) for value in args.rows.split(",")], args.repeats)
        return
    backend = load_model(args.model, dtype="int4").backend
    if not isinstance(backend, NativeLlama):
        raise SystemExit("this measures the native backend's int4 linears")
    linears = [module for module in backend.layers.modules() if isinstance(module, Int4Linear)]
    head = backend.lm_head
    head_kernel = head.kernel if isinstance(head, Int8Linear) else type(head).__name__
    print(f"{len(linears)} int4 products per pass, kernel {','.join(int4_kernels(backend))}; head {head_kernel}")
    print("rows  int4 products ms  head ms")
    with torch.no_grad():
        for rows in (int(value) for value in args.rows.split(",")):
            inputs = {size: torch.randn(rows, size).to(torch.bfloat16) for size in {m.in_features for m in linears}}
            hidden = torch.randn(rows, backend.shape.hidden_size).to(torch.bfloat16)

            def products(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for linear in linears:
                    linear.product(inputs[linear.in_features])

            def lm_head(hidden: torch.Tensor = hidden) -> object:
                return head(hidden)

            print(f"{rows:4d}  {median_ms(products, args.repeats):16.2f}  {median_ms(lm_head, args.repeats):7.2f}")


def bf16_products(model: str, row_counts: list[int], repeats: int) -> None:
    backend = load_model(model, dtype="bfloat16").backend
    if not isinstance(backend, NativeLlama):
        raise SystemExit("this measures the native backend's bf16 linears")
    linears = [module for module in backend.layers.modules() if isinstance(module, Bf16BlockLinear | nn.Linear)]
    kinds = sorted({type(module).__name__ for module in linears})
    reordered = [(m.in_features, pack(m.weight.detach().contiguous(), MIN_ROWS_PER_CALL)) for m in linears]
    print(f"{len(linears)} bf16 products per pass, as loaded: {','.join(kinds)}")
    print("rows  as loaded ms  oneDNN reordered ms  as loaded ms  oneDNN reordered ms")
    with torch.no_grad():
        for rows in row_counts:
            inputs = {size: torch.randn(rows, size).to(torch.bfloat16) for size in {m.in_features for m in linears}}

            def loaded(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for linear in linears:
                    linear(inputs[linear.in_features])

            def onednn(inputs: dict[int, torch.Tensor] = inputs) -> None:
                for in_features, weight in reordered:
                    packed_product(inputs[in_features], weight)

            times = [median_ms(run, repeats) for run in (loaded, onednn, loaded, onednn)]
            print(f"{rows:4d}  " + "  ".join(f"{value:7.2f}" for value in times))


if __name__ == "__main__":
    main()
