"""The engine: continuous batching equals plain decoding, isolation between requests, freeing, seeds."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from rsmem import Batch, Context
from rsmem.engine import Engine, FinishReason, IncrementalDetokenizer, SamplingParams, TextTokenizer
from rsmem.models import DecayedSumModel

EOS = 256


def byte_tokenizer() -> TextTokenizer:
    """Byte-level BPE without merges: token i is byte i, plus an end-of-text token 256."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), sorted(alphabet, key=_byte_of), strict=True)}
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab["<eos>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return TextTokenizer(tok, bos_token_id=None, eos_token_id=EOS)


def _byte_of(ch: str) -> int:
    """GPT-2's byte -> printable character map, inverted."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs, strict=True))[ch]


def make_engine(n_seq_max: int = 8, max_batch_tokens: int = 32, tokenizer=None, n_vocab: int = 257):
    model = DecayedSumModel(n_vocab=n_vocab, n_embd=6, n_layer=2, seed=3)
    ctx = Context(model, n_seq_max=n_seq_max, n_batch=64, n_ubatch=16)
    return model, Engine(ctx, tokenizer, max_batch_tokens=max_batch_tokens)


def run_alone(prompt: list[int], params: SamplingParams) -> list[tuple[int, ...]]:
    _, engine = make_engine(n_seq_max=params.n)
    engine.add_request(prompt, params)
    final = [o for o in engine.run_until_done() if o.finished]
    return [c.token_ids for c in final[0].outputs]


def test_greedy_engine_equals_step_by_step_decode():
    model, engine = make_engine()
    prompt = [
        5,
        9,
        13,
        2,
        7,
        1,
        30,
        4,
        8,
        8,
        3,
        60,
        70,
        12,
        11,
        10,
        9,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
        16,
        17,
        18,
        19,
        20,
    ]  # longer than max_batch_tokens: prefilled in chunks
    engine.add_request(prompt, SamplingParams.greedy(max_tokens=12))
    out = [o for o in engine.run_until_done() if o.finished][0]

    ctx = Context(model, n_seq_max=1)
    ctx.decode(Batch(prompt))
    want = []
    for _ in range(12):
        tok = int(torch.argmax(ctx.get_logits(-1)))
        want.append(tok)
        ctx.decode(Batch([tok]))
    assert list(out.outputs[0].token_ids) == want
    assert out.outputs[0].finish_reason is FinishReason.LENGTH


def test_sixteen_requests_at_once_equal_each_run_alone():
    rng = random.Random(7)
    requests = []
    for i in range(16):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(
            temperature=0.8,
            top_k=20,
            seed=100 + i,
            n=rng.choice([1, 1, 2, 3]),
            max_tokens=rng.randrange(1, 10),
        )
        requests.append((prompt, params))
    _, engine = make_engine(n_seq_max=6, max_batch_tokens=24)
    ids = [engine.add_request(p, sp) for p, sp in requests]
    final = {o.request_id: o for o in engine.run_until_done() if o.finished}
    for rid, (prompt, params) in zip(ids, requests, strict=True):
        got = [c.token_ids for c in final[rid].outputs]
        assert got == run_alone(prompt, params), rid
        assert all(len(t) == params.max_tokens for t in got)
    assert engine.ctx.memory.used == 0
    assert sorted(engine.pool.free) == list(range(6))


def test_n_completions_prefill_the_prompt_once_and_differ():
    model, engine = make_engine(n_seq_max=4)
    seen: list[int] = []
    forward = model.forward

    def counting_forward(ubatch, states):
        seen.extend(ubatch.tokens)
        return forward(ubatch, states)

    model.forward = counting_forward
    prompt = list(range(40, 60))
    engine.add_request(prompt, SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=5))
    out = [o for o in engine.run_until_done() if o.finished][0]
    assert engine.stats.prompt_tokens == len(prompt)
    assert len(seen) == len(prompt) + 4 * 4  # the prompt once, then 4 decode steps of 4 sequences
    assert len({c.token_ids for c in out.outputs}) > 1
    assert engine.ctx.memory.used == 0


def test_seeds_reproduce_and_differ():
    params = SamplingParams(temperature=1.5, seed=42, max_tokens=8)
    a = run_alone([1, 2, 3], params)
    assert a == run_alone([1, 2, 3], params)
    assert a != run_alone([1, 2, 3], SamplingParams(temperature=1.5, seed=43, max_tokens=8))


def test_abort_frees_sequences_running_and_waiting():
    _, engine = make_engine(n_seq_max=2)
    first = engine.add_request(list(range(10)), SamplingParams(n=2, max_tokens=50, seed=0))
    second = engine.add_request([1, 2], SamplingParams(max_tokens=50, seed=0))
    engine.step()
    engine.step()
    assert engine.ctx.memory.used == 2
    assert engine.abort(second)  # still waiting: no sequence free
    assert engine.abort(first)
    assert not engine.abort(first)
    assert engine.ctx.memory.used == 0
    reports = engine.step()
    assert {r.request_id for r in reports} == {first, second}
    assert all(c.finish_reason is FinishReason.ABORT for r in reports for c in r.outputs)
    assert not engine.has_unfinished
    assert sorted(engine.pool.free) == [0, 1]


def test_waiting_requests_take_freed_sequences():
    _, engine = make_engine(n_seq_max=2)
    ids = [engine.add_request([i + 1], SamplingParams(max_tokens=3 + i, seed=i)) for i in range(5)]
    max_running = 0
    done = []
    while engine.has_unfinished:
        done += [o.request_id for o in engine.step() if o.finished]
        max_running = max(max_running, engine.ctx.memory.used)
    assert sorted(done) == sorted(ids)
    assert max_running == 2
    assert engine.ctx.memory.used == 0


class ScriptedModel(DecayedSumModel):
    """Keeps the toy model's states but always predicts ``script[pos + 1]`` after position ``pos``."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(n_vocab=257, n_embd=4, n_layer=1)
        self.script = script

    def forward(self, ubatch, states):
        super().forward(ubatch, states)
        logits = torch.full((ubatch.n_outputs, self.n_vocab), -10.0)
        for row, i in enumerate(ubatch.output_rows()):
            logits[row, self.script[ubatch.pos[i] + 1]] = 10.0
        return logits


def scripted_engine(text: bytes, tail: list[int]) -> Engine:
    model = ScriptedModel(list(text) + tail)
    return Engine(Context(model, n_seq_max=2), byte_tokenizer(), max_batch_tokens=8)


def test_stop_string_cuts_text_and_streams_consistently():
    prompt = "Once"
    engine = scripted_engine(prompt.encode() + b" upon a time, the end", [EOS])
    engine.add_request(prompt, SamplingParams.greedy(max_tokens=40, stop=("me,", "zzz")))
    reports = list(engine.run_until_done())
    c = reports[-1].outputs[0]
    assert c.text == " upon a ti"
    assert "".join(r.outputs[0].delta_text for r in reports) == c.text
    assert c.finish_reason is FinishReason.STOP
    assert engine.ctx.memory.used == 0


def test_eos_finishes_and_multibyte_text_streams_whole_characters():
    prompt = "x"
    engine = scripted_engine(prompt.encode() + "né€".encode(), [EOS, 65])
    engine.add_request(prompt, SamplingParams.greedy(max_tokens=40))
    reports = list(engine.run_until_done())
    deltas = [r.outputs[0].delta_text for r in reports]
    assert [d for d in deltas if d] == ["n", "é", "€"]
    c = reports[-1].outputs[0]
    assert c.text == "né€" and c.token_ids[-1] == EOS
    assert c.finish_reason is FinishReason.STOP
    engine.add_request(prompt, SamplingParams.greedy(max_tokens=8, ignore_eos=True))
    c = [r for r in engine.run_until_done() if r.finished][0].outputs[0]
    assert c.text.endswith("€A")


def test_incremental_detokenizer_holds_back_partial_characters():
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(b) for b in "añ€!".encode()]
    assert pieces == ["a", "", "ñ", "", "", "€", "!"]
    assert detok.text == "añ€!"


def test_bad_requests_are_rejected():
    _, engine = make_engine(n_seq_max=2)
    with pytest.raises(ValueError, match="n = 3 completions"):
        engine.add_request([1], SamplingParams(n=3))
    with pytest.raises(ValueError, match="prompt token 1: id 999"):
        engine.add_request([1, 999])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text")
    engine.add_request([1], request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], request_id="x")


def _greedy_continuation(model, tokens: list[int], n: int) -> list[int]:
    ctx = Context(model, n_seq_max=1)
    ctx.decode(Batch(tokens))
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(ctx.get_logits(-1))))
        ctx.decode(Batch(out[-1:]))
    return out


def test_session_carries_state_between_turns_and_through_a_file(tmp_path):
    model, engine = make_engine(n_seq_max=3)
    session = engine.open_session()
    turn1, turn2, turn3 = [5, 6, 7], [8, 9], [10]
    greedy = SamplingParams.greedy(max_tokens=4)
    engine.add_request(turn1, greedy, session=session)
    g1 = list(next(o for o in engine.run_until_done() if o.finished).outputs[0].token_ids)
    engine.add_request(turn2, greedy, session=session)
    g2 = list(next(o for o in engine.run_until_done() if o.finished).outputs[0].token_ids)
    assert g1 == _greedy_continuation(model, turn1, 4)
    assert g2 == _greedy_continuation(model, turn1 + g1 + turn2, 4)
    # only new tokens were processed: the pending last token and the new prompt
    assert engine.stats.prompt_tokens == len(turn1) + 1 + len(turn2)
    assert engine.ctx.memory.seq_pos_max(session.seq_id) >= 0

    path = tmp_path / "chat.ggsq"
    engine.save_session(session, str(path))
    assert session.tokens == turn1 + g1 + turn2 + g2

    _, fresh = make_engine(n_seq_max=2)
    resumed = fresh.open_session(str(path))
    assert resumed.tokens == session.tokens
    fresh.add_request(turn3, greedy, session=resumed)
    g3 = list(next(o for o in fresh.run_until_done() if o.finished).outputs[0].token_ids)
    assert g3 == _greedy_continuation(model, session.tokens + turn3, 4)
    assert fresh.stats.prompt_tokens == len(turn3)

    engine.close_session(session)
    assert engine.ctx.memory.used == 0 and sorted(engine.pool.free) == [0, 1, 2]


def test_session_rules():
    _, engine = make_engine(n_seq_max=2)
    session = engine.open_session()
    with pytest.raises(ValueError, match="n must be 1 for a session"):
        engine.add_request([1], SamplingParams(n=2), session=session)
    engine.add_request([1], SamplingParams(max_tokens=3), session=session)
    with pytest.raises(ValueError, match="busy"):
        engine.add_request([1], session=session)
    with pytest.raises(RuntimeError, match="request running"):
        engine.save_session(session, "unused")
    list(engine.run_until_done())
    engine.close_session(session)
    with pytest.raises(ValueError, match="closed"):
        engine.add_request([1], session=session)


def test_prompt_cache_reuses_a_finished_requests_state():
    model = DecayedSumModel(n_vocab=257, n_embd=6, n_layer=2, seed=3)
    engine = Engine(Context(model, n_seq_max=2), prompt_cache=True)
    greedy = SamplingParams.greedy(max_tokens=3)
    engine.add_request([1, 2, 3, 4], greedy)
    first = next(o for o in engine.run_until_done() if o.finished).outputs[0].token_ids
    assert engine.ctx.memory.used == 1 and engine.active_cells() == 0
    follow = [1, 2, 3, 4, *first, 9, 9]
    engine.add_request(follow, greedy)
    out = next(o for o in engine.run_until_done() if o.finished).outputs[0].token_ids
    assert list(out) == _greedy_continuation(model, follow, 3)
    assert engine.stats.cached_prompt_tokens == 4 + 2  # prompt and the fed generated tokens
    assert engine.stats.prompt_tokens == 4 + (len(follow) - 6)
    # a prompt that does not extend the cache starts from scratch in a fresh sequence
    engine.add_request([7, 7], greedy)
    out = next(o for o in engine.run_until_done() if o.finished).outputs[0].token_ids
    assert list(out) == _greedy_continuation(model, [7, 7], 3)


def test_slot_save_erase_restore_continues_like_an_uninterrupted_run(tmp_path):
    model = DecayedSumModel(n_vocab=257, n_embd=6, n_layer=2, seed=3)
    engine = Engine(Context(model, n_seq_max=3), prompt_cache=True)
    greedy = SamplingParams.greedy(max_tokens=4)
    engine.add_request([5, 6, 7], greedy, slot=1)
    gen = list(next(o for o in engine.run_until_done() if o.finished).outputs[0].token_ids)
    assert engine.snapshot().slots[1].n_cached_tokens == 3 + 3
    path = tmp_path / "slot1.ggsq"
    n_tokens, size = engine.slot_save(1, str(path))
    assert n_tokens == 6 and size == path.stat().st_size
    assert engine.slot_erase(1) == 6
    assert engine.ctx.memory.used == 0
    assert engine.slot_restore(2, str(path)) == 6
    follow = [5, 6, 7, *gen, 11]
    engine.add_request(follow, greedy, slot=2)
    out = list(next(o for o in engine.run_until_done() if o.finished).outputs[0].token_ids)
    assert out == _greedy_continuation(model, follow, 4)
    assert engine.stats.cached_prompt_tokens == 6


def test_slot_errors():
    _, engine = make_engine(n_seq_max=2)
    with pytest.raises(ValueError, match="slot 5 does not exist"):
        engine.slot_erase(5)
    with pytest.raises(ValueError, match="slot 2 does not exist"):
        engine.add_request([1], slot=2)
    engine.add_request([1], SamplingParams(max_tokens=5), slot=0)
    engine.step()
    with pytest.raises(RuntimeError, match="slot 0 is busy"):
        engine.slot_save(0, "unused")


def test_llm_generate_stream_and_astream_agree():
    import asyncio

    from rsmem.engine import LLM

    model = DecayedSumModel(n_vocab=257, n_embd=6, n_layer=2, seed=3)
    llm = LLM(model, tokenizer=byte_tokenizer(), n_seq_max=2)
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=10)
    whole = llm.generate(["abc", "de"], params)
    assert [o.request_id for o in whole] == sorted(o.request_id for o in whole)
    streamed = "".join(o.outputs[0].delta_text for o in llm.stream("abc", params))
    assert streamed == whole[0].text

    async def collect() -> str:
        return "".join([o.outputs[0].delta_text async for o in llm.astream("de", params)])

    assert asyncio.run(collect()) == whole[1].text
    assert llm.context.memory.used == 0


BYTE_TOKENIZER = byte_tokenizer()  # one for every example: its byte table is made once


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 256), max_size=40))
def test_byte_level_detokenizer_streams_what_decode_gives(ids):
    tok = BYTE_TOKENIZER
    assert tok.byte_pieces() is not None  # the fast path is what this test checks
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
    # a delta never ends inside a character that later bytes complete
    for k in range(len(ids)):
        assert tok.decode(ids[: k + 1]).startswith("".join(deltas[: k + 1]))


def test_detokenizer_without_byte_pieces_takes_the_decoding_path():
    tok = byte_tokenizer()
    tok.tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
    assert tok.byte_pieces() is None
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(b) for b in "añ".encode()] == ["a", "", "ñ"]
