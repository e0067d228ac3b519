"""BatchAllocator's run-wise init and cursor-based split_equal against the token-by-token rules they
replace (llama.cpp's): positions auto-filled per sequence, sets taken in order of their first unused
token, the same tokens in every micro-batch, whatever the splits before."""

from __future__ import annotations

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from rsmem import Batch, BatchAllocator, InvalidBatchError

pytestmark = pytest.mark.fuzz


class Stored:
    def __init__(self, last: dict[int, int]) -> None:
        self.last = last

    def seq_pos_max(self, seq_id: int) -> int:
        return self.last.get(seq_id, -1)


def ref_positions(seq_ids: list[tuple[int, ...]], memory: Stored) -> list[int]:
    next_pos: dict[int, int] = {}
    pos = []
    for ids in seq_ids:
        if ids[0] not in next_pos:
            next_pos[ids[0]] = memory.seq_pos_max(ids[0]) + 1
        p = next_pos[ids[0]]
        pos.append(p)
        for s in ids:
            next_pos[s] = p + 1
    return pos


def ref_split_equal(seq_ids: list[tuple[int, ...]], used: set[int], n_ubatch: int) -> list[int]:
    masks = [sum(1 << s for s in ids) for ids in seq_ids]
    sets: list[int] = []
    union = 0
    for i, mask in enumerate(masks):
        if i in used or union & mask:
            continue
        sets.append(mask)
        union |= mask
        if len(sets) >= n_ubatch:
            break
    if not sets:
        return []
    pending = [[i for i, m in enumerate(masks) if m == mask and i not in used] for mask in sets]
    n_per_set = min(min(len(p) for p in pending), max(1, n_ubatch // len(sets)))
    return [i for p in pending for i in p[:n_per_set]]


id_sets = st.sampled_from([(0,), (1,), (2,), (3,), (0, 1), (2, 3)])


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(id_sets, min_size=1, max_size=40),
    stored=st.dictionaries(st.integers(0, 3), st.integers(-1, 50)),
    splits=st.lists(st.tuples(st.sampled_from(["equal", "seq", "simple"]), st.integers(1, 12)), max_size=30),
)
def test_init_and_splits_match_the_token_by_token_rules(ids, stored, splits):
    memory = Stored(stored)
    balloc = BatchAllocator()
    try:  # coupled sets often break a sequence's positions: such batches are refused, as before
        balloc.init(Batch(list(range(len(ids))), seq_ids=ids), n_vocab=64, n_seq_max=4, memory=memory,
                    allow_coupled=True)  # fmt: skip
    except InvalidBatchError:
        reject()
    assert balloc.seq_ids == ids
    assert balloc.pos == ref_positions(ids, memory)
    used: set[int] = set()
    for kind, n in [*splits, *[("equal", 4)] * 40]:
        if kind == "equal":
            want = ref_split_equal(ids, used, n)
            ub = balloc.split_equal(n)
            assert (list(ub.batch_index) if ub is not None else []) == want
        else:
            ub = balloc.split_seq(n) if kind == "seq" else balloc.split_simple(n)
        if ub is not None:
            assert list(ub.tokens) == list(ub.batch_index)  # token i is i
            assert list(ub.pos) == [balloc.pos[i] for i in ub.batch_index]
            used.update(ub.batch_index)
    assert balloc.n_used == len(used) == len(ids)
