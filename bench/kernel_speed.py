"""The quantized products of one decoding pass, by rows: the int4 linears of every layer in pass order
(each reads its weights from memory, as in a pass) and the int8 LM head, median ms (docs/int4-kernel.md).

The kernel is the one loading picks for this CPU; ``CAUSALDRAFT_INT4_KERNEL=torch`` runs torch's
instead, for a comparison in a second process (on a busy or drifting machine, compare runs made
back to back, and rerun).

    .venv/bin/python bench/kernel_speed.py
    CAUSALDRAFT_INT4_KERNEL=torch .venv/bin/python bench/kernel_speed.py
"""

from __future__ import annotations

import argparse

import torch
from pass_cost import median_ms  # bench/: the script's own directory

from causaldraft.models.loading import load_model
from causaldraft.models.native import NativeLlama
from causaldraft.models.quant import Int4Linear, Int8Linear, int4_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", default="1,2,3,4,8,16")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
