"""The DSpark confidence scheduler's decisions at one row, step by step: one chat answer of 96 tokens on the real
target (bfloat16, 2 threads), the drafter at K drafts; each cut's drafting estimate, losing streak, kept drafts,
raw survivals and correction, then each step's width, accepted drafts, drafting and step milliseconds.
python docs/measurements/scheduler_steps.py K"""
import sys

import torch

import specdec
from specdec import schedule
from specdec.decode import GenerationConfig
from specdec.drafters.registry import build
from specdec.engine import generate_ids
from specdec.models import kernels
from specdec.zoo import zoo_path

torch.set_num_threads(2)
kernels.set_threads(2)
target = specdec.load_target("smollm2-135m", dtype="bfloat16", backend="native")
drafter = build("dspark", zoo_path("smollm2-135m/dspark"))
chat = [{"role": "user", "content": "Explain how a hash map works, with a short Python example."}]
prompt = target.encode([target.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)])[0]
log = []
cut, observe = schedule.ConfidenceScheduler.cut, schedule.ConfidenceScheduler.observe


def logged_cut(self, engine, group, proposal):
    kept = cut(self, engine, group, proposal)
    rows = proposal.tokens.shape[0]
    log.append(f"cut: drafting {1e3 * self.drafting_seconds(rows, proposal.k):.2f} ms, losing {self.losing}, kept "
               f"{int(kept.lengths.max())}, survivals {[round(float(x), 2) for x in schedule.survivals(proposal.confidence)[0]]}, "
               f"correction {[round(float(c), 2) for c in self.correction(proposal.k)]}")
    return kept


def logged_observe(self, engine, group, width, proposed, accepted, timing):
    log.append(f"step: width {width}, accepted {accepted}, drafting {1e3 * timing['draft']:.2f} ms, "
               f"step {1e3 * timing['step']:.2f} ms")
    return observe(self, engine, group, width, proposed, accepted, timing)


schedule.ConfidenceScheduler.cut, schedule.ConfidenceScheduler.observe = logged_cut, logged_observe
policy = schedule.ConfidenceScheduler()
out = generate_ids(target, [prompt], drafter, GenerationConfig(num_draft_tokens=int(sys.argv[1]), max_new_tokens=96),
                   policy)
print("\n".join(log))
drafted = sum(1 for line in log if line.startswith("step: width") and not line.startswith("step: width 0"))
print(f"{drafted} drafting steps of {out.stats.verify_steps}; profile (rows, width) -> ms "
      f"{ {key: round(1e3 * value, 2) for key, value in policy.table.items()} }")
