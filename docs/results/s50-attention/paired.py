"""The attention kernel's AVX-512 build (or, with ``--build avx2``, its AVX2 build) at two git revisions, in one
process, turn by turn: ms for 30 layers of the default model's shape (9 heads, 3 kv heads, head size 64, bf16
cache), a chain of n rows after L committed positions, median of 21 rounds. Each revision's source is built under
an operator name of its own; the outputs of the revisions must be equal bit for bit.

    .venv/bin/python docs/results/s50-attention/paired.py 2c471e3 HEAD --contexts 64,256,1024,2048 --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from causaldraft.models import attention_kernel
from causaldraft.models.blocked import blocked_keys

SOURCE = "causaldraft/models/kernels/attention.cpp"


def build(revision: str, name: str, directory: Path, flags: tuple[str, ...]) -> None:
    text = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], capture_output=True, text=True, check=True).stdout
    text = text.replace("attend_blocked(Tensor q", f"{name}(Tensor q")
    text = text.replace('m.impl("attend_blocked"', f'm.impl("{name}"')
    source = directory / f"{name}.cpp"
    source.write_text(text)
    (directory / name).mkdir()
    cpp_extension.load(name=f"paired_{name}", sources=[str(source)], extra_cflags=list(flags),
                       build_directory=str(directory / name), is_python_module=False)  # fmt: skip


def layout(length: int, n: int) -> tuple[torch.Tensor, ...]:
    mask = torch.zeros(n, length + n, dtype=torch.bool)
    mask[:, :length] = True
    for i in range(n):
        mask[i, length : length + i + 1] = True
    keys = blocked_keys(mask, torch.arange(length, length + n), length, n)
    assert keys is not None
    return keys.tensors()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revisions", nargs=2)
    parser.add_argument("--contexts", default="64,256,1024,2048")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--build", choices=("avx512", "avx2"), default="avx512")
    args = parser.parse_args()
    flags = attention_kernel.AVX512_FLAGS if args.build == "avx512" else attention_kernel.FLAGS
    names = ["before", "after"]
    with tempfile.TemporaryDirectory() as scratch:
        for revision, name in zip(args.revisions, names, strict=True):
            build(revision, name, Path(scratch), flags)
    ops = [getattr(torch.ops.causaldraft, name) for name in names]
    generator = torch.Generator().manual_seed(0)
    print(f"{args.build} build, ms per pass (30 layers): {args.revisions[0]} / {args.revisions[1]}")
    for length in map(int, args.contexts.split(",")):
        caches = [
            tuple(torch.randn(1, 3, length + 128, 64, generator=generator).bfloat16() for _ in range(2))
            for _ in range(30)
        ]
        cells = []
        for n in map(int, args.rows.split(",")):
            q = torch.randn(1, 9, n, 64, generator=generator)
            keys = layout(length, n)
            times: list[list[float]] = [[], []]
            outputs = []
            for _ in range(21):
                outputs = []
                for op, spent in zip(ops, times, strict=True):
                    started = time.perf_counter()
                    for k, v in caches:
                        out = op(q, k, v, *keys)
                    spent.append(time.perf_counter() - started)
                    outputs.append(out)
            assert torch.equal(outputs[0], outputs[1]), "the revisions' outputs differ"
            before, after = (sorted(spent)[10] * 1e3 for spent in times)
            cells.append(f"n={n}: {before:.2f} / {after:.2f}")
        print(f"L={length:5d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
