"""The shipped Q4_1 file drafting for the float model, without and with draft vocabularies (its head's rows
restricted to each file's ids), all in one bench run so the ratios compare.

    python docs/measurements/draft_vocab_ab.py DTYPE KS PROMPTS_PER_SET VOCAB.json [VOCAB.json ...]

Vocabularies: ``specdec train draft-vocab --drafter DIR --target smollm2-135m --size N`` writes one into DIR.
"""

import sys

import torch

import specdec
from specdec.backends.hf import load_tokenizer
from specdec.commands.bench import format_table, run_bench
from specdec.drafters import DraftModel
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks


def main():
    dtype, ks, count = sys.argv[1], [int(k) for k in sys.argv[2].split(",")], int(sys.argv[3])
    torch.set_num_threads(2)
    target = specdec.load_target("smollm2-135m", dtype=dtype)
    tokenizer = load_tokenizer(zoo_path("smollm2-135m"))
    texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=tokenizer)[:count]]
    drafters = [("draft-model", DraftModel("smollm2-135m-q4_1", draft_vocab=False))]
    drafters += [("draft-model", DraftModel("smollm2-135m-q4_1", draft_vocab=path)) for path in sys.argv[4:]]
    result = run_bench(target, target.encode(texts), ks=ks, max_new_tokens=128, with_transformers=False,
                       drafters=tuple(drafters))
    print(format_table(result))


if __name__ == "__main__":
    main()
