import sys, torch
from torch.profiler import profile, ProfilerActivity
from causaldraft.models.loading import load_model
dtype = sys.argv[1]; rows = int(sys.argv[2]); compiled = len(sys.argv) > 3
loaded = load_model("default", dtype=dtype)
backend = loaded.backend
if compiled:
    from causaldraft.api import compile_backend
    compile_backend(loaded, progress=False)
context = 128
cache = backend.new_cache(context + 40)
backend.forward(torch.zeros(context, dtype=torch.long), torch.arange(context), torch.ones(context, context, dtype=torch.bool).tril(), cache)
def step():
    backend.forward(torch.zeros(rows, dtype=torch.long), torch.arange(context, context + rows),
                    torch.ones(rows, context + rows, dtype=torch.bool).tril(context), cache).scores.first_maxima()
    cache.rollback(context)
with torch.no_grad():
    for _ in range(3): step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10): step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
