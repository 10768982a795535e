"""Save (or compare with) the attention kernel's outputs on 385 cases: trees, chains, padded passes, two-sequence
batches, head sizes 16-128, fp32 and bf16 caches; at one and two threads (which must agree). Run once on the old
source (save), once on the new (compare):

    CAUSALDRAFT_ATTENTION_KERNEL=avx512 .venv/bin/python docs/results/s50-attention/same_bits.py save /tmp/ref.pt
    CAUSALDRAFT_ATTENTION_KERNEL=avx512 .venv/bin/python docs/results/s50-attention/same_bits.py compare /tmp/ref.pt
"""
import sys, torch, random
from pathlib import Path
from causaldraft.models import attention_kernel
from causaldraft.models.blocked import blocked_keys, stack_keys
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.test_attention_kernel import tree_layout
assert attention_kernel.available()
def make():
    g = torch.Generator().manual_seed(0); rnd = random.Random(0)
    cases = []
    for hd, kv, heads in ((64, 3, 9), (64, 1, 5), (128, 2, 8), (32, 1, 4), (16, 2, 2), (48, 2, 10), (64, 2, 12), (64, 3, 3)):
        for length in (1, 7, 64, 129, 300, 1030):
            for n in (1, 2, 3, 5, 8, 13, 16, 32):
                parents = [-1] + [rnd.randrange(i) for i in range(1, n)]
                if rnd.random() < 0.3: parents = [-1] + list(range(n - 1))
                mask, positions = tree_layout(length, parents)
                rows = n if rnd.random() < 0.7 else n + 3
                lay = blocked_keys(mask, positions, length, rows)
                if lay is None: continue
                keys = 3 * torch.randn(1, kv, length + 200, hd, generator=g)
                values = torch.randn(1, kv, length + 200, hd, generator=g)
                q = torch.randn(1, heads, rows, hd, generator=g)
                dt = torch.bfloat16 if rnd.random() < 0.6 else torch.float32
                cases.append((q, keys.to(dt), values.to(dt), *lay.tensors()))
    # two sequences batched, different lengths
    for n in (1, 4, 9):
        seqs, qs = [], []
        for length in (50, 705):
            parents = [-1] + [rnd.randrange(i) for i in range(1, n)]
            mask, positions = tree_layout(length, parents)
            from causaldraft.models.blocked import sequence_keys
            seqs.append(sequence_keys(mask, positions, length, n))
        lay = stack_keys(seqs)
        keys = torch.randn(2, 3, 1000, 64, generator=g).bfloat16(); values = torch.randn(2, 3, 1000, 64, generator=g).bfloat16()
        cases.append((torch.randn(2, 9, n, 64, generator=g), keys, values, *lay.tensors()))
    return cases
cases = make()
outs = [attention_kernel.attend(*c) for c in cases]
for threads in (1, 2):
    torch.set_num_threads(threads)
    again = [attention_kernel.attend(*c) for c in cases]
    assert all(torch.equal(a, b) for a, b in zip(outs, again)), "thread count changed bits"
if sys.argv[1] == "save":
    torch.save(outs, sys.argv[2]); print("saved", len(outs))
else:
    ref = torch.load(sys.argv[2])
    bad = [i for i, (a, b) in enumerate(zip(ref, outs)) if not torch.equal(a, b)]
    print("cases", len(outs), "differ", len(bad), bad[:10])
