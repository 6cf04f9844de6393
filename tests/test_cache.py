"""The per-row cache: rollback, compaction and row selection keep every row's computation exact."""

from __future__ import annotations

import torch

from specdec.batch import Backlog, keep_rows, leaving_order


def full_logits(model, rows):
    """Reference: each row alone, no cache, in transformers. rows: list of token lists -> list of [len, V]."""
    with torch.no_grad():
        return [model(torch.tensor([r])).logits[0] for r in rows]


def test_holes_rollback_and_compaction_are_exact(targets, hf_models):
    target, model = targets["llama"], hf_models["llama"]
    torch.manual_seed(0)
    rows = [torch.randint(0, target.vocab_size, (n,)).tolist() for n in (9, 4, 6)]
    cache = target.new_cache(3)
    # Prefill ragged rows (left-padded), then append blocks whose tails are rejected per row.
    width = max(map(len, rows))
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    target.forward(cache, tokens, valid)
    generator = torch.Generator().manual_seed(1)
    for step in range(12):
        block = torch.randint(0, target.vocab_size, (3, 5), generator=generator)
        keep = torch.randint(1, 6, (3,), generator=generator)
        logits, _ = target.forward(cache, block, logits_to_keep=5)
        for b in range(3):
            expected = full_logits(model, [rows[b] + block[b].tolist()])[0][-5:]
            assert torch.allclose(logits[b], expected, atol=1e-4), (step, b)
        cache.truncate(cache.lengths - 5 + keep)
        for b in range(3):
            rows[b] += block[b, : keep[b]].tolist()
        if step % 3 == 2:
            cache.compact(slack=0.0, minimum=0)
            assert cache.columns == max(map(len, rows))
        assert cache.lengths.tolist() == [len(r) for r in rows]
    cache.select_rows(torch.tensor([2, 0]))
    logits, _ = target.forward(cache, torch.tensor([[5], [6]]))
    expected = full_logits(model, [rows[2] + [5], rows[0] + [6]])
    assert torch.allclose(logits[0, -1], expected[0][-1], atol=1e-4)
    assert torch.allclose(logits[1, -1], expected[1][-1], atol=1e-4)


def test_memory_stays_bounded_under_ragged_acceptance(targets):
    target = targets["gpt2"]
    cache = target.new_cache(4)
    target.forward(cache, torch.ones(4, 3, dtype=torch.long))
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        target.forward(cache, torch.ones(4, 5, dtype=torch.long), logits_to_keep=1)
        keep = torch.randint(1, 6, (4,), generator=generator)
        keep[0] = 1  # one row always rejects everything
        cache.truncate(cache.lengths - 5 + keep)
        cache.compact()
        longest = int(cache.lengths.max())
        assert cache.columns <= longest + max(32, longest // 2)


def test_hidden_states_of_chosen_layers(targets, hf_models):
    target = targets["qwen3"]
    tokens = torch.tensor([[3, 4, 5, 6]])
    _, hidden = target.forward(target.new_cache(1), tokens, hidden_layers=(0, 1, 2))
    with torch.no_grad():
        reference = hf_models["qwen3"](tokens, output_hidden_states=True).hidden_states
    assert hidden.shape == (1, 4, 3, target.config.hidden_size)
    for i in range(3):
        assert torch.allclose(hidden[:, :, i], reference[i], atol=1e-5)


def test_logits_for_chosen_positions_on_both_backends(targets, hf_models):
    """A [B, m] index of block columns gives the same logits as keeping them all and picking."""
    target = targets["llama"]
    tokens = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    everything, _ = target.forward(target.new_cache(2), tokens, logits_to_keep=5)
    chosen = torch.tensor([[0, 3], [4, 4]])
    picked, _ = target.forward(target.new_cache(2), tokens, logits_to_keep=chosen)
    assert picked.shape == (2, 2, target.vocab_size)
    assert torch.allclose(picked, everything[torch.arange(2)[:, None], chosen], atol=1e-5)
    reference = hf_models["llama"](tokens).logits
    assert torch.allclose(picked[1, 0], reference[1, 4], atol=1e-4)


def test_extended_caches_compute_what_each_row_computes_alone(targets):
    """Rows joining a batch (caches of other widths and capacities, appended with ``extend``) keep their
    logits; the native cache's unused columns hold finite numbers, since attention adds 0 x value."""
    for arch, target in targets.items():
        first, second = target.new_cache(2, 40), target.new_cache(1, 90)
        a = torch.tensor([[5, 6, 7, 8, 9], [1, 1, 2, 3, 4]])
        b = torch.tensor([[9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3]])
        target.forward(first, a)
        target.forward(second, b)
        first.extend(second)
        if hasattr(first, "kv"):
            assert torch.isfinite(first.kv[..., :first.columns, :]).all(), arch  # holes zeroed
        step = torch.tensor([[11], [12], [13]])
        logits, _ = target.forward(first, step)
        for row, prompt in enumerate([a[0], a[1], b[0]]):
            alone = target.new_cache(1, 40)
            expected, _ = target.forward(alone, torch.cat([prompt, step[row]])[None])
            assert torch.allclose(logits[row, -1], expected[0, -1], atol=1e-5), (arch, row)


def test_keep_rows_moves_only_what_moves_and_keeps_order():
    store = torch.arange(6.0)[:, None].repeat(1, 3)
    kept = keep_rows(store, torch.tensor([0, 2, 5]))
    assert kept is store and kept[:3, 0].tolist() == [0.0, 2.0, 5.0]  # in place, rows 3.. now free
    other = torch.arange(4.0)[:, None]
    shuffled = keep_rows(other, torch.tensor([2, 0]))  # row 0 would be read after slot 0 was written
    assert shuffled is not other and shuffled[:, 0].tolist() == [2.0, 0.0] and other[:, 0].tolist() == [0, 1, 2, 3]


def test_a_departure_moves_the_last_rows_into_the_leaving_slots_in_place():
    """leaving_order fills each leaving row's slot with one of the last rows; keep_rows moves just those rows,
    in place, and with ``used`` only their live columns."""
    assert leaving_order(6, {1, 4}) == [0, 5, 2, 3]
    assert leaving_order(6, {4, 5}) == [0, 1, 2, 3] and leaving_order(3, {0, 1, 2}) == []
    assert leaving_order(5, {0, 2}) == [3, 1, 4]
    for size in range(1, 7):  # every subset: a permutation of the rows that stay
        for mask in range(1 << size):
            gone = {row for row in range(size) if mask >> row & 1}
            order = leaving_order(size, gone)
            assert sorted(order) == sorted(set(range(size)) - gone)
            store = torch.arange(size * 4.0).reshape(size, 4).clone()
            reference = store.clone()
            kept = keep_rows(store, torch.tensor(order, dtype=torch.long), used=(1, 3))
            assert kept is store  # in place: no new store
            assert torch.equal(kept[:len(order), :3], reference[order, :3])
            moved = [slot for slot, row in enumerate(order) if row != slot]
            assert torch.equal(kept[moved, 3], reference[moved, 3])  # past ``used``: not copied
    cache = torch.arange(2 * 5 * 3.0).reshape(2, 5, 3)  # rows along dim 1, ``used`` along dim 2
    reference = cache.clone()
    keep_rows(cache, torch.tensor(leaving_order(5, {1})), dim=1, used=(2, 2))
    assert torch.equal(cache[:, :4, :2], reference[:, [0, 4, 2, 3], :2]) and torch.equal(cache[:, 1, 2], reference[:, 1, 2])


def test_backlog_keeps_each_rows_waiting_columns_in_order_through_leaves_and_joins():
    """Against a plain list per row: what a row waits for is its valid columns, in the order they came."""
    generator = torch.Generator().manual_seed(0)

    def columns(batch, n):
        states = torch.randn(batch, n, 3, generator=generator)
        valid = torch.rand(batch, n, generator=generator) > 0.3
        return states, valid

    def check(backlog, expected):
        states, valid = backlog.waiting()
        assert backlog.batch_size == len(expected)
        for b, row in enumerate(expected):
            got = states[b][valid[b]] if states is not None else torch.zeros(0, 3)
            assert torch.equal(got, torch.stack(row) if row else torch.zeros(0, 3)), b

    def append(backlog, expected, n):
        states, valid = columns(backlog.batch_size, n)
        backlog.append(states, valid)
        for b, row in enumerate(expected):
            row.extend(states[b][valid[b]])

    backlog, expected = Backlog(3), [[], [], []]
    for n in (5, 1, 1, 2, 1, 1, 1):  # a prompt's columns, then steps: the buffer doubles, reused after clear
        append(backlog, expected, n)
    check(backlog, expected)
    backlog.select_rows(torch.tensor([0, 2]))
    expected = [expected[0], expected[2]]
    check(backlog, expected)
    newcomer, more = Backlog(2), [[], []]
    append(newcomer, more, 20)  # joining rows wait for more columns than the others
    backlog.extend(newcomer)
    expected += more
    check(backlog, expected)
    append(backlog, expected, 1)
    check(backlog, expected)
    backlog.clear()
    expected = [[] for _ in expected]
    check(backlog, expected)
    backlog.extend(Backlog(1))  # nothing waits on either side
    expected.append([])
    append(backlog, expected, 2)
    check(backlog, expected)
    backlog.select_rows(torch.tensor([4, 0]))  # out of order
    check(backlog, [expected[4], expected[0]])
