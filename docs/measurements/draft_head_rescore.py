"""The shipped Q4_1 file drafting for its float model (staged on prompt lookup, G = 3) with its Q8_0 head, against
the same file whose head is requantized to a cheaper block type and whose top-K columns per row are then rescored
in float32 with the Q8_0 rows (the drafts' argmax over those K): all in one bench run.

    python docs/measurements/draft_head_rescore.py DTYPE PROMPTS_PER_SET KS TOPKS [QTYPE]

e.g. ``bfloat16 3 8 4,16``: 3 sharegpt + 3 humaneval held-out prompts, k = 8, a Q4_1 head rescored at its top 4
and at its top 16.
"""
import sys
import torch
import specdec
from specdec.backends.hf import load_tokenizer
from specdec.commands.bench import format_table, run_bench
from specdec.drafters import DraftModel
from specdec.models import kernels
from specdec.models.kernels import QMatrix
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

dtype, count, ks, K = sys.argv[1], int(sys.argv[2]), [int(k) for k in sys.argv[3].split(",")], [int(x) for x in sys.argv[4].split(",")]
qt = sys.argv[5] if len(sys.argv) > 5 else "Q4_1"
torch.set_num_threads(2)
target = specdec.load_target("smollm2-135m", dtype=dtype)
tokenizer = load_tokenizer(zoo_path("smollm2-135m"))
texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=tokenizer)[:count]]
drafters = [("draft-model", DraftModel("smollm2-135m-q4_1", staged="prompt-lookup", staged_guesses=3))]
for k in K:
    drafter = DraftModel("smollm2-135m-q4_1", staged="prompt-lookup", staged_guesses=3)
    model = drafter.backend.model
    head = model.head
    rows = head.dequantize().t().contiguous()          # [V, H] float32
    head4 = QMatrix.quantize(rows, qt, head.gain)
    gain, eps = head.gain, model.eps

    def logits(hidden, head4=head4, rows=rows, gain=gain, eps=eps, k=k):
        h = hidden.contiguous()
        rough = kernels.linear(h, head4, norm_eps=eps)
        flat = rough.reshape(-1, rough.shape[-1])
        cand = flat.topk(k, dim=-1).indices                     # [R, k]
        hf = h.reshape(-1, h.shape[-1]).float()
        normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * gain
        exact = torch.einsum("rh,rkh->rk", normed, rows[cand])
        out = torch.full_like(flat, float("-inf"))
        out.scatter_(1, cand, exact.to(out.dtype))
        return out.reshape(rough.shape)

    model.logits = logits
    print(f"head {head.qtype} {head.nbytes / 2**20:.1f} MiB -> {qt} {head4.nbytes / 2**20:.1f} MiB, top-{k} rescored", flush=True)
    drafters.append(("draft-model", drafter))
result = run_bench(target, target.encode(texts), ks=ks, max_new_tokens=128, with_transformers=False, drafters=tuple(drafters))
print(format_table(result))
