"""Logits processing a model's generation config asks for, applied exactly at every verified position.

``model.generate(do_sample=False)`` applies the processors of the model's generation config
(repetition penalty, no-repeat n-grams, forced or suppressed tokens, minimum lengths, bad words).
specdec applies the same processors to the target's logits at each position it verifies, with
that position's own context (committed tokens plus the drafts before it), so greedy output still
equals ``generate`` and sampling still follows the processed, warped target distribution.
"""

from __future__ import annotations

import warnings

import torch

from specdec.backends import hf
from specdec.batch import Sequences


class GenerationProcessors:
    def __init__(self, model, prompt_lengths: list[int], max_new_tokens: list[int], device=None):
        # Processors depend on the prompt length and the token budget (minimum new tokens, forced EOS),
        # so one list per (prompt length, max_new_tokens).
        self.lists = {(n, m): hf.logits_processors(model, n, m, device)
                      for n, m in sorted(set(zip(prompt_lengths, max_new_tokens)))}
        self.names = sorted({type(p).__name__ for procs in self.lists.values() for p in procs or ()})

    @classmethod
    def for_target(cls, target, prompts: list[list[int]], max_new_tokens: int | list[int]) -> "GenerationProcessors | None":
        """None when the target's generation config asks for no logits processing (the usual case).
        max_new_tokens: one for all prompts, or each prompt's."""
        if target.generation_config is None:
            return None
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        try:
            model = target.generation_model()
            processors = cls(model, [len(p) for p in prompts], list(max_new_tokens), target.device)
        except Exception as exc:  # an unusual generation config: say what is not applied, once
            warnings.warn(f"specdec does not apply {target.name}'s generation-config logits processing "
                          f"({hf.first_line(exc)}); outputs may differ from model.generate()", stacklevel=3)
            return None
        return processors if processors.names else None

    @staticmethod
    def merged(first: "GenerationProcessors | None", second: "GenerationProcessors | None"):
        """The processors of two sets of rows joined in one batch."""
        if first is None or second is None:
            return first or second
        first.lists.update(second.lists)
        first.names = sorted(set(first.names) | set(second.names))
        return first

    def apply(self, seqs: Sequences, prompt_lengths: torch.Tensor, logits: torch.Tensor,
              drafts: torch.Tensor | None = None, parents: torch.Tensor | None = None,
              budgets: torch.Tensor | None = None) -> torch.Tensor:
        """Processed logits [B, m, V]: position j of row b continues its committed tokens + drafts[b, :j],
        or for a tree (``parents`` [B, m - 1]) the drafts on the path to node j - 1.

        prompt_lengths, budgets: [B] of the live rows (their max_new_tokens); drafts: [B, m - 1] or None (m = 1).
        """
        out = logits.float().clone()
        for row in range(logits.shape[0]):
            processors = self.lists[(int(prompt_lengths[row]), int(budgets[row]))]
            if processors is None:
                continue
            length = int(seqs.lengths[row])
            context = seqs.tokens[row, :length]
            if drafts is not None:
                context = torch.cat([context, drafts[row]])
            for j in range(logits.shape[1]):
                if parents is None or j == 0:
                    ids = context[: length + j]
                else:  # the committed tokens, then the path root -> node j - 1
                    path, node = [], j - 1
                    while node >= 0:
                        path.append(length + node)
                        node = int(parents[row, node])
                    ids = torch.cat([context[:length], context[path[::-1]]])
                out[row, j] = processors(ids[None], out[row, j][None])[0]
        return out
