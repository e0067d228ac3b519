"""Context.decode: the allocator -> init_batch -> apply -> forward flow, outputs, and failures."""

from __future__ import annotations

import pytest
import torch

from helpers.memory import decode_seq, snapshot, toy_context
from rsmem import Batch, BatchAllocator, Context, InvalidBatchError, NoSlotError
from rsmem.models import DecayedSumModel

ATOL = 1e-5


def test_whole_prompt_logits_match_plain_replay():
    model, ctx = toy_context()
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    ctx.decode(Batch(tokens, logits=[True] * len(tokens)))
    torch.testing.assert_close(ctx.logits, model.reference_logits(tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_ubatch", [1, 3, 512])
def test_chunked_prefill_and_token_by_token_agree(n_ubatch):
    model, ctx = toy_context(n_ubatch=n_ubatch)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    ref = model.reference_logits(tokens)
    decode_seq(ctx, 0, tokens[:4])
    torch.testing.assert_close(ctx.get_logits(-1), ref[3], atol=ATOL, rtol=0)
    decode_seq(ctx, 0, tokens[4:7])
    torch.testing.assert_close(ctx.get_logits(2), ref[6], atol=ATOL, rtol=0)
    for k in range(7, 10):
        decode_seq(ctx, 0, [tokens[k]])
        torch.testing.assert_close(ctx.get_logits(0), ref[k], atol=ATOL, rtol=0)


def test_many_sequences_of_different_lengths_in_one_batch():
    model, ctx = toy_context(n_seq_max=4, n_ubatch=5)
    prompts = {0: [1, 2, 3, 4, 5], 1: [6], 2: [7, 8, 9], 3: [10, 11]}
    ctx.decode(Batch.from_sequences(prompts, all_logits=True))
    got = ctx.logits
    want = torch.cat([model.reference_logits(p) for p in prompts.values()])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # a second step continues each one
    ctx.decode(Batch.from_sequences({s: [20 + s] for s in prompts}))
    for k, (s, p) in enumerate(prompts.items()):
        torch.testing.assert_close(
            ctx.get_logits(k), model.reference_logits([*p, 20 + s])[-1], atol=ATOL, rtol=0
        )


def test_interleaved_batch_outputs_come_back_in_batch_order():
    model, ctx = toy_context(n_seq_max=2)
    batch = Batch([1, 2, 3, 4], seq_ids=[[0], [1], [0], [1]], logits=[True] * 4)
    ctx.decode(batch)
    ref0, ref1 = model.reference_logits([1, 3]), model.reference_logits([2, 4])
    torch.testing.assert_close(
        ctx.logits, torch.stack([ref0[0], ref1[0], ref0[1], ref1[1]]), atol=ATOL, rtol=0
    )


def test_forked_sequence_continues_two_ways():
    model, ctx = toy_context(n_seq_max=3)
    decode_seq(ctx, 0, [1, 2, 3])
    ctx.memory.seq_cp(0, 1)
    ctx.memory.seq_cp(0, 2)
    ctx.decode(Batch.from_sequences({0: [4], 1: [5, 6], 2: [7]}, all_logits=True))
    want = torch.cat(
        [
            model.reference_logits([1, 2, 3, 4])[3:],
            model.reference_logits([1, 2, 3, 5, 6])[3:],
            model.reference_logits([1, 2, 3, 7])[3:],
        ]
    )
    torch.testing.assert_close(ctx.logits, want, atol=ATOL, rtol=0)
    ctx.memory.check_invariants()
    assert ctx.memory.used == 3


def test_get_logits_of_non_output_token_is_an_error():
    model, ctx = toy_context()
    decode_seq(ctx, 0, [1, 2, 3])
    with pytest.raises(IndexError, match="token 0"):
        ctx.get_logits(0)
    with pytest.raises(IndexError, match="output -2"):
        ctx.get_logits(-2)
    assert ctx.get_logits(2).shape == (32,)


def test_batch_without_outputs_is_allowed():
    model, ctx = toy_context()
    ctx.decode(Batch([1, 2], logits=[False, False]))
    assert ctx.logits.shape == (0, 32)
    assert ctx.memory.seq_pos_max(0) == 1


@pytest.mark.parametrize(
    "batch",
    [
        Batch([1, 99]),  # token out of vocab
        Batch([1], seq_ids=[[9]]),  # unknown sequence
        Batch([1], pos=[0]),  # sequence 0 is at 2: must continue at 3
        Batch([1, 2], pos=[3, 5]),  # gap
        Batch([1], seq_ids=[[0, 1]]),  # coupled
        Batch(list(range(9))),  # more than n_batch = 8
    ],
)
def test_invalid_batch_leaves_memory_and_logits_unchanged(batch):
    model, ctx = toy_context(n_seq_max=2, n_batch=8)
    decode_seq(ctx, 0, [1, 2, 3])
    before, logits = snapshot(ctx.memory), ctx.logits.clone()
    with pytest.raises(InvalidBatchError):
        ctx.decode(batch)
    before.assert_same(snapshot(ctx.memory))
    assert torch.equal(ctx.logits, logits)


def test_no_slot_leaves_memory_unchanged(monkeypatch):
    model, ctx = toy_context(n_seq_max=2)
    decode_seq(ctx, 0, [1, 2, 3])
    before = snapshot(ctx.memory)
    monkeypatch.setattr(ctx.memory, "find_slot", lambda ub: False)
    with pytest.raises(NoSlotError, match="no memory slot"):
        ctx.decode(Batch([4], seq_ids=[[1]]))
    before.assert_same(snapshot(ctx.memory))


def test_model_failure_drops_the_batch_sequences():
    model, ctx = toy_context(n_seq_max=2)
    decode_seq(ctx, 0, [1, 2, 3])
    decode_seq(ctx, 1, [4])

    def broken(ubatch, states):
        raise RuntimeError("boom")

    ctx.model.forward = broken
    with pytest.raises(RuntimeError, match="boom"):
        decode_seq(ctx, 1, [5])
    assert ctx.memory.seq_pos_max(1) == -1
    assert ctx.memory.seq_pos_max(0) == 2


def test_full_memory_of_distinct_sequences_still_fits():
    model, ctx = toy_context(n_seq_max=4)
    ctx.decode(Batch.from_sequences({s: [s + 1] for s in range(4)}))
    for s in range(4):
        ctx.memory.seq_cp(s, (s + 1) % 4)  # rotate shares; every cell stays referenced
    ctx.decode(Batch.from_sequences({s: [9] for s in range(4)}))
    ctx.memory.check_invariants()
    assert ctx.memory.used == 4


def test_state_dtype_bf16_runs():
    model = toy_context()[0]
    ctx = Context(model, n_seq_max=1, state_dtype=torch.bfloat16)
    decode_seq(ctx, 0, [1, 2, 3])
    torch.testing.assert_close(ctx.get_logits(-1), model.reference_logits([1, 2, 3])[-1], atol=0.2, rtol=0.05)
    assert ctx.memory.s_l[0].dtype == torch.bfloat16


class InPlaceDecayedSum(DecayedSumModel):
    """The toy model updating the state rows it is given in place (as a fast decode kernel would)."""

    def forward(self, ubatch, states):
        x = self.embedding[ubatch.token_tensor()].to(torch.float32)
        for il in range(self.n_layer):
            r, s = states.read_states(il)
            outs = []
            for t in range(x.shape[1]):
                xt = x[:, t]
                s.mul_(float(self.decay[il])).add_(xt)
                outs.append(xt + s + 0.5 * r)
                r.copy_(xt)
            states.write_states(il, r, s)
            x = torch.stack(outs, dim=1)
        return (x.reshape(-1, self.n_embd)[ubatch.output_rows()].double() @ self.head).float()


def test_in_place_state_updates_through_views():
    model = InPlaceDecayedSum(n_vocab=32, n_embd=4, n_layer=2)
    ctx = Context(model, n_seq_max=3)
    ctx.decode(Batch.from_sequences({0: [1, 2], 1: [3]}))
    ctx.memory.seq_cp(0, 2)  # seq 2 shares seq 0's row: its next step must gather a copy
    for step in range(3):
        ctx.decode(Batch.from_sequences({0: [4 + step], 1: [5 + step], 2: [6 + step]}, all_logits=True))
    want = [
        model.reference_logits([1, 2, 4, 5, 6])[-1],
        model.reference_logits([3, 5, 6, 7])[-1],
        model.reference_logits([1, 2, 6, 7, 8])[-1],
    ]
    torch.testing.assert_close(ctx.logits, torch.stack(want), atol=1e-4, rtol=1e-5)


def test_steady_decode_reads_states_without_copying():
    model, ctx = toy_context(n_seq_max=2)
    ctx.decode(Batch.from_sequences({0: [1], 1: [2]}))
    balloc = BatchAllocator()
    balloc.init(Batch.from_sequences({0: [3], 1: [4]}), n_vocab=32, n_seq_max=2, memory=ctx.memory)
    mctx = ctx.memory.init_batch(balloc, 8)
    mctx.apply()
    r, s = mctx.read_states(0)
    assert s.data_ptr() == ctx.memory.s_l[0][mctx.head].data_ptr()


def test_steady_decode_reads_the_same_views_step_after_step():
    """read_states hands out the very same view objects while a step's placement is the last one's (what
    lets a model keep what it built from them); another placement gets views of its own rows."""
    model, ctx = toy_context(n_seq_max=3)
    ctx.decode(Batch.from_sequences({0: [1], 1: [2]}))

    def placed(seqs: dict[int, list[int]]) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        balloc = BatchAllocator()
        balloc.init(Batch.from_sequences(seqs), n_vocab=32, n_seq_max=3, memory=ctx.memory)
        mctx = ctx.memory.init_batch(balloc, 8)
        mctx.apply()
        return mctx.head, mctx.read_states(1)

    head, first = placed({0: [3], 1: [4]})
    again_head, again = placed({0: [5], 1: [6]})
    assert again_head == head and again[0] is first[0] and again[1] is first[1]
    one_head, one = placed({1: [7]})
    assert one[0] is not first[0] and one[0].shape == (1, ctx.memory.r_l[1].shape[1])
    assert one[1].data_ptr() == ctx.memory.s_l[1][one_head].data_ptr()
    _, back = placed({0: [8], 1: [9]})
    assert back[0] is not one[0] and back[1].data_ptr() == first[1].data_ptr()


def test_outputs_of_one_micro_batch_in_order_are_the_models_own_logits():
    """A decode step (one token a sequence, every one an output) keeps the model's logits as they are."""
    model, ctx = toy_context(n_seq_max=3)
    for s in range(3):
        decode_seq(ctx, s, [1 + s, 2 + s])
    returned: list[torch.Tensor] = []
    forward = model.forward

    def spy(*args, **kwargs):
        returned.append(forward(*args, **kwargs))
        return returned[-1]

    model.forward = spy
    ctx.decode(Batch.from_sequences({s: [7 + s] for s in range(3)}))
    assert len(returned) == 1 and ctx.logits is returned[0]  # not copied
    for s in range(3):
        want = model.reference_logits([1 + s, 2 + s, 7 + s])[-1]
        torch.testing.assert_close(ctx.get_logits(s), want, atol=ATOL, rtol=0)
    # outputs from two micro-batches are gathered into one new tensor
    ctx.decode(Batch.from_sequences({0: [4, 5], 1: [6]}, all_logits=True))
    assert all(ctx.logits is not r for r in returned[1:])
    want = torch.cat([model.reference_logits([1, 2, 7, 4, 5])[3:], model.reference_logits([2, 3, 8, 6])[3:]])
    torch.testing.assert_close(ctx.logits, want, atol=ATOL, rtol=0)
