"""BatchAllocator: the validation rules, auto-fill and splits of SPEC section 2."""

from __future__ import annotations

import pytest

from helpers.memory import decode_seq, toy_context
from rsmem import Batch, BatchAllocator, InvalidBatchError


class FakePositions:
    def __init__(self, last: dict[int, int]) -> None:
        self.last = last

    def seq_pos_max(self, seq_id: int) -> int:
        return self.last.get(seq_id, -1)


def init(batch: Batch, memory=None, **kw) -> BatchAllocator:
    balloc = BatchAllocator()
    balloc.init(batch, n_vocab=kw.pop("n_vocab", 50), n_seq_max=kw.pop("n_seq_max", 4), memory=memory, **kw)
    return balloc


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (Batch([]), "no tokens"),
        (Batch([1, 50]), "token 1: id 50 is outside the vocabulary"),
        (Batch([1, -3]), "token 1: id -3"),
        (Batch([1, 2], seq_ids=[[0], [4]]), "token 1: seq_id 4 is outside"),
        (Batch([1, 2], seq_ids=[[0], [-1]]), "token 1: seq_id -1"),
        (Batch([1, 2], seq_ids=[[0], []]), "token 1: has no sequence id"),
        (Batch([1, 2], seq_ids=[[0], [1, 1]]), "repeat a sequence"),
        (Batch([1, 2], seq_ids=[[0], [0, 1]]), "token 1: belongs to sequences \\[0, 1\\]"),
        (Batch([1, 2], seq_ids=[[0]]), "seq_ids has 1 entries for 2 tokens"),
        (Batch([1, 2], pos=[0]), "pos has 1 entries"),
        (Batch([1, 2], pos=[0, -1]), "token 1: position -1 is negative"),
        (Batch([1, 2], logits=[True]), "logits has 1 entries"),
        (Batch([1, 2, 3], pos=[0, 1, 3]), "token 2: position 3 of sequence 0 does not follow 1"),
        (Batch([1, 2], pos=[1, 1]), "token 1: position 1 of sequence 0 does not follow 1"),
        (Batch([1, 2], pos=[2, 1]), "token 1: position 1"),
    ],
)
def test_invalid_batches_name_index_and_value(batch, message):
    with pytest.raises(InvalidBatchError, match=message):
        init(batch)


def test_invalid_batch_error_is_a_value_error():
    with pytest.raises(ValueError):
        init(Batch([99]))


def test_sequence_with_state_must_continue_at_next_position():
    mem = FakePositions({0: 9})
    with pytest.raises(InvalidBatchError, match=r"X = 9.*Y = X \+ 1 = 10"):
        init(Batch([1], pos=[12]), memory=mem)
    with pytest.raises(InvalidBatchError, match="starts at position 9"):
        init(Batch([1], pos=[9]), memory=mem)
    init(Batch([1], pos=[10]), memory=mem)
    # an empty sequence may start anywhere
    init(Batch([1], pos=[100], seq_ids=[[1]]), memory=mem)


def test_autofill_defaults():
    balloc = init(Batch([1, 2, 3]), memory=FakePositions({0: 4}))
    assert balloc.seq_ids == [(0,), (0,), (0,)]
    assert balloc.pos == [5, 6, 7]
    assert balloc.outputs == [False, False, True]


def test_autofill_positions_per_sequence_interleaved():
    batch = Batch([1, 2, 3, 4, 5], seq_ids=[[0], [1], [0], [2], [1]])
    balloc = init(batch, memory=FakePositions({1: 2}))
    assert balloc.pos == [0, 3, 1, 0, 4]


def test_output_all_marks_every_token():
    assert init(Batch([1, 2]), output_all=True).outputs == [True, True]


def test_coupled_tokens_allowed_when_asked():
    balloc = init(Batch([1], seq_ids=[[0, 2]]), allow_coupled=True)
    assert balloc.seq_ids == [(0, 2)]


# ------------------------------------------------------------------ splits


def _interleaved() -> BatchAllocator:
    # seq 0: 3 tokens, seq 1: 2 tokens, seq 2: 3 tokens, interleaved
    seqs = [[0], [1], [2], [0], [1], [2], [0], [2]]
    return init(Batch(list(range(8)), seq_ids=seqs, logits=[True] * 8))


def test_split_equal_takes_the_same_count_from_each_sequence():
    balloc = _interleaved()
    ub = balloc.split_equal(n_ubatch=64)
    assert (ub.n_seqs, ub.n_seq_tokens) == (3, 2)
    assert ub.primary_seq_ids == [0, 1, 2]
    assert ub.batch_index == (0, 3, 1, 4, 2, 5)
    assert ub.pos == (0, 1, 0, 1, 0, 1)
    ub2 = balloc.split_equal(n_ubatch=64)
    assert (ub2.n_seqs, ub2.n_seq_tokens, ub2.batch_index) == (2, 1, (6, 7))
    assert balloc.split_equal(n_ubatch=64) is None
    assert balloc.n_used == balloc.n_tokens == 8


def test_split_equal_respects_n_ubatch():
    balloc = _interleaved()
    sizes = []
    while (ub := balloc.split_equal(n_ubatch=2)) is not None:
        assert ub.n_tokens <= 2
        assert ub.n_seqs * ub.n_seq_tokens == ub.n_tokens
        sizes.append((ub.n_seqs, ub.n_seq_tokens))
    assert sizes[0] == (2, 1)
    assert balloc.n_used == 8


def test_split_equal_sequential_needs_consecutive_seq_ids():
    balloc = init(Batch([1, 2, 3], seq_ids=[[0], [2], [1]]))
    ub = balloc.split_equal(n_ubatch=8, sequential=True)
    assert ub.primary_seq_ids == [0, 1]
    assert balloc.split_equal(n_ubatch=8, sequential=True).primary_seq_ids == [2]


def test_split_seq_takes_one_sequence_at_a_time():
    balloc = _interleaved()
    ub = balloc.split_seq(n_ubatch=64)
    assert ub.n_seqs == 1 and ub.batch_index == (0, 3, 6)
    assert balloc.split_seq(n_ubatch=1).batch_index == (1,)


def test_split_simple_takes_tokens_in_order():
    balloc = _interleaved()
    ub = balloc.split_simple(n_ubatch=5)
    assert ub.batch_index == (0, 1, 2, 3, 4)
    assert not ub.equal_seqs and ub.n_seqs == 5
    assert balloc.split_simple(n_ubatch=5).batch_index == (5, 6, 7)
    assert balloc.split_simple(n_ubatch=5) is None


def test_split_reset_starts_over():
    balloc = _interleaved()
    balloc.split_simple(8)
    balloc.split_reset()
    assert balloc.n_used == 0
    assert balloc.split_simple(8).n_tokens == 8


def test_ubatch_reserve_shape():
    ub = BatchAllocator.ubatch_reserve(3, 2)
    assert (ub.n_tokens, ub.n_seqs, ub.n_seq_tokens, ub.equal_seqs) == (6, 2, 3, True)


def test_ubatch_token_tensor_groups_sequences():
    ub = _interleaved().split_equal(64)
    assert ub.token_tensor().tolist() == [[0, 3], [1, 4], [2, 5]]


def test_batch_from_sequences():
    b = Batch.from_sequences({2: [7, 8], 0: [9]}, start_pos={2: 5, 0: 0})
    assert list(b.tokens) == [7, 8, 9]
    assert list(b.pos) == [5, 6, 0]
    assert [list(s) for s in b.seq_ids] == [[2], [2], [0]]
    assert list(b.logits) == [False, True, True]


def test_allocator_reads_positions_from_a_real_memory():
    model, ctx = toy_context()
    decode_seq(ctx, 1, [1, 2, 3])
    balloc = init(Batch([4], seq_ids=[[1]]), memory=ctx.memory, n_vocab=32)
    assert balloc.pos == [3]
