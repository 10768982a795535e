"""stop 57: the 120 int4 products of a pass, shipped int4_mm against the variant of int4_mm_r8.patch.
    .venv/bin/python docs/results/s57-int4-rows/run.py 1   (from the repository root)"""
import sys, time, statistics, torch
from torch.utils.cpp_extension import load
from causaldraft.models import int4_kernel
from causaldraft.models.loading import load_model
from causaldraft.models.quant import Int4Linear
rows8 = int(sys.argv[1]) if len(sys.argv) > 1 else 1
flags = list(int4_kernel.BF16_FLAGS) + [f"-DROWS8={rows8}"]
# the variant: the shipped kernel with int4_mm_r8.patch applied (run from the repository's root)
import shutil, subprocess, tempfile, pathlib
work = pathlib.Path(tempfile.mkdtemp())
shutil.copy("causaldraft/models/kernels/int4_mm.cpp", work / "int4_mm_r8.cpp")
subprocess.run(["patch", str(work / "int4_mm_r8.cpp"), "docs/results/s57-int4-rows/int4_mm_r8.patch"], check=True)
load(name=f"s57proto_r8_{rows8}", sources=[str(work / "int4_mm_r8.cpp")], extra_cflags=flags, verbose=False,
     is_python_module=False)
backend = load_model("default", dtype="int4").backend
linears = [m for m in backend.layers.modules() if isinstance(m, Int4Linear)]
assert all(m.kernel == "blocks" for m in linears)
torch.manual_seed(0)
for rows in (1, 7, 8, 9, 12, 16, 17, 33):
    x = torch.randn(rows, linears[0].in_features).to(torch.bfloat16)
    a = int4_kernel.product(x, linears[0].packed)
    b = torch.ops.s57proto.int4_mm(x, linears[0].packed)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), rows
print("bits equal")
inputs = {r: {s: torch.randn(r, s).to(torch.bfloat16) for s in {m.in_features for m in linears}} for r in (1, 4, 8, 16)}
times = {(k, r): [] for k in ("old", "new") for r in (1, 4, 8, 16)}
for it in range(41):
    for r in (1, 4, 8, 16):
        for k in ("old", "new"):
            t = time.perf_counter()
            for m in linears:
                x = inputs[r][m.in_features]
                int4_kernel.product(x, m.packed) if k == "old" else torch.ops.s57proto.int4_mm(x, m.packed)
            times[(k, r)].append(time.perf_counter() - t)
for r in (1, 4, 8, 16):
    print(r, *(f"{k} {statistics.median(times[(k, r)][2:]) * 1e3:.2f}" for k in ("old", "new")))
