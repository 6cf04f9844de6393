"""The shipped Q4_1 file drafting for its float model (staged on prompt lookup, G = 3) with its Q8_0 head as it
is and requantized to other block types, all in one bench run so the ratios compare.

    python docs/measurements/draft_head_ab.py DTYPE PROMPTS_PER_SET KS QTYPE [QTYPE ...]

e.g. ``bfloat16 4 8 Q4_1``: 4 sharegpt + 4 humaneval held-out prompts, k = 8, the head also as Q4_1 blocks
(the dequantized Q8_0 rows quantized again, as llama.cpp's reference quantizer does).
"""
import sys

import torch

import specdec
from specdec.backends.hf import load_tokenizer
from specdec.commands.bench import format_table, run_bench
from specdec.drafters import DraftModel
from specdec.models.kernels import QMatrix
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks


def main():
    dtype, count, ks = sys.argv[1], int(sys.argv[2]), [int(k) for k in sys.argv[3].split(",")]
    torch.set_num_threads(2)
    target = specdec.load_target("smollm2-135m", dtype=dtype)
    tokenizer = load_tokenizer(zoo_path("smollm2-135m"))
    texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=tokenizer)[:count]]
    drafters = [("draft-model", DraftModel("smollm2-135m-q4_1", staged="prompt-lookup", staged_guesses=3))]
    for qtype in sys.argv[4:]:
        drafter = DraftModel("smollm2-135m-q4_1", staged="prompt-lookup", staged_guesses=3)
        model = drafter.backend.model
        head = model.head
        model.head = QMatrix.quantize(head.dequantize().t().contiguous(), qtype, head.gain)
        print(f"head {head.qtype} {head.nbytes / 2**20:.1f} MiB -> {qtype} {model.head.nbytes / 2**20:.1f} MiB",
              flush=True)
        drafters.append(("draft-model", drafter))
    result = run_bench(target, target.encode(texts), ks=ks, max_new_tokens=128, with_transformers=False,
                       drafters=tuple(drafters))
    print(format_table(result))


if __name__ == "__main__":
    main()
