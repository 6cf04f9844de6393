import torch

import random

from specdec.drafters.prompt_lookup import lookup, match_starts


def t(values):
    return torch.tensor(values)


def test_longest_ngram_wins_over_more_recent_shorter_match():
    # tail (1, 2, 3): the 3-gram occurs at 0 (followed by 9); the 1-gram 3 also occurs later followed by 7.
    tokens = t([1, 2, 3, 9, 8, 3, 7, 5, 1, 2, 3])
    assert lookup(tokens, max_ngram=3, min_ngram=1, k=2).tolist() == [9, 8]


def test_most_recent_occurrence_is_used():
    tokens = t([4, 5, 1, 4, 6, 2, 4])
    assert lookup(tokens, max_ngram=1, min_ngram=1, k=2).tolist() == [6, 2]


def test_falls_back_to_shorter_ngrams_and_respects_min_ngram():
    tokens = t([7, 3, 8, 1, 3])
    assert lookup(tokens, max_ngram=3, min_ngram=1, k=3).tolist() == [8, 1, 3]
    assert lookup(tokens, max_ngram=3, min_ngram=2, k=3).tolist() == []


def test_overlapping_continuation_extends_the_period_and_never_matches_itself():
    tokens = t([1, 2, 1, 2])
    # tail (1, 2) matches at 0, followed by 1, 2 (the tail itself); the pattern repeats with period 2
    assert lookup(tokens, max_ngram=2, min_ngram=1, k=5).tolist() == [1, 2, 1, 2, 1]
    # period 3: tail (5,) last occurred 3 tokens back, followed by 6, 7, then the tail 5 again
    assert lookup(t([9, 5, 6, 7, 5]), max_ngram=1, min_ngram=1, k=7).tolist() == [6, 7, 5, 6, 7, 5, 6]
    assert lookup(t([5]), max_ngram=3, min_ngram=1, k=4).tolist() == []
    assert lookup(t([1, 2, 3]), max_ngram=3, min_ngram=1, k=4).tolist() == []


def test_match_starts_are_every_earlier_occurrence_longest_tail_first():
    """The longest tail is bisected (a tail that occurs makes every shorter one occur): the starts are what
    scanning every n-gram from the longest down gives, most recent first within each n."""
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(1, 40))]
        max_ngram = rng.randrange(1, 9)
        min_ngram = rng.randrange(1, max_ngram + 1)
        expected = [start + n for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1)
                    for start in reversed(range(len(tokens) - n))
                    if tokens[start: start + n] == tokens[len(tokens) - n:]]
        assert list(match_starts(t(tokens), max_ngram, min_ngram)) == expected, (tokens, max_ngram, min_ngram)
