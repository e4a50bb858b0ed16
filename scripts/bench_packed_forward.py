import sys, time, torch, statistics
sys.path.insert(0, "python")
from specadapt.engine import load_model
from specadapt.engine.kv import RaggedKVCache
t = load_model("smollm2-135m")
torch.manual_seed(0)
for B, n, counts in [(4, 3, [3, 1, 2, 1]), (4, 8, [2, 1, 8, 1]), (16, 8, [1] * 12 + [8, 3, 2, 2])]:
    res = {}
    for packed in (False, True, False, True):
        kv = RaggedKVCache(t.model, B, packed=packed, pack_below=1.0)
        kv.forward(torch.randint(0, 1000, (B, 200)), torch.full((B,), 200))
        ids = torch.randint(0, 1000, (B, n)); c = torch.tensor(counts)
        times = []
        for _ in range(12):
            t0 = time.perf_counter(); kv.forward(ids, c, output_hidden_states=True); times.append(time.perf_counter() - t0)
            kv.truncate(kv.lengths - c)
        res.setdefault(packed, []).append(statistics.median(times[2:]) * 1e3)
    print(B, n, counts, "padded ms", [round(x, 1) for x in res[False]], "packed ms", [round(x, 1) for x in res[True]])
