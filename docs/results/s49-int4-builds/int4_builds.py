"""The two int4 builds' products over 30 layers of the default model's shapes, per row count, alternating
processes (each build defines the same operator). Usage: python int4_builds.py [child]"""
import json, os, statistics, subprocess, sys, time
import torch
ROWS = (1, 2, 4, 8, 16)
if len(sys.argv) > 1:
    from causaldraft.models.int4_kernel import available
    from causaldraft.models.quant import Int4Linear, Int4Weights
    assert available()
    g = torch.Generator().manual_seed(0)
    linears = []
    for _ in range(30):
        for o, i in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
            v = torch.randint(0, 16, (o, i), generator=g, dtype=torch.uint8)
            s = torch.rand(o, i // 32, generator=g) * 0.01; z = (torch.rand(o, i // 32, generator=g) - 0.5) * 0.01
            linears.append(Int4Linear(Int4Weights(v, s, z), None))
    inputs = {r: torch.randn(r, 1536, generator=g).to(torch.bfloat16) for r in ROWS}
    t = {r: [] for r in ROWS}
    with torch.inference_mode():
        for _ in range(12):
            for r in ROWS:
                a = time.perf_counter()
                for lin in linears:
                    lin(inputs[r][:, : lin.in_features].contiguous())
                t[r].append(time.perf_counter() - a)
    print(json.dumps({r: statistics.median(x[2:]) * 1000 for r, x in t.items()}))
    sys.exit()
for round_ in range(3):
    for isa in ("avx512_bf16", "vnni"):
        out = subprocess.run([sys.executable, __file__, "child"], env={**os.environ, "CAUSALDRAFT_INT4_KERNEL": isa},
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(isa.ljust(12), " ".join(f"{r}:{ms:6.2f}" for r, ms in json.loads(out).items()), flush=True)
