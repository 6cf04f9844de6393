"""Time per engine step against the forward pass it runs: one chat request, 128 new tokens, plain decoding and
prompt lookup k = 4 (best of 3 generations), beside forward_times of 1 and 5 tokens. python engine_steps.py DTYPE"""
import sys, torch
import specdec
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.models import kernels
from specdec.backends.costs import forward_times
torch.set_num_threads(2); kernels.set_threads(2)
t = specdec.load_target("smollm2-135m", dtype=sys.argv[1], backend="native")
prompt = [{"role": "user", "content": "Rewrite this function in Python with comments: def add(a, b): return a + b. Then explain what it does and list three test cases for it."}]
for name, d in (("plain", None), ("pl", PromptLookup())):
    best = None
    for _ in range(3):
        out = specdec.generate(t, [prompt], d, num_draft_tokens=4, max_new_tokens=128)
        s = out.stats
        if best is None or s.total_time < best.total_time: best = s
    d_ = best.__dict__
    print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d_.items() if isinstance(v, (int, float))})
ft = forward_times(t.backend, [1, 5], 250, repeats=10)
print({k: round(1e3 * v, 3) for k, v in ft.items()})
