"""Structured outputs in the engine: every constrained answer of the embedded model matches its schema,
grammar, regex or choice (checked with jsonschema and re, not with the library that enforced it);
a constraint that cannot be enforced is refused before anything runs; a matcher's failure fails its
request alone."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import byte_tokenizer

from helpers.rwkv_reference import random_rwkv7, world_vocab, write_rwkv_gguf
from rsmem.context import Context
from rsmem.engine import LLM, Engine, FinishReason, RequestOutput, SamplingParams
from rsmem.engine.constraints import Constraint, ConstraintCompiler, mask_constrained
from rsmem.engine.request import Completion, Request
from rsmem.errors import InvalidRequestError
from rsmem.loaders import load_model
from rsmem.loaders.rwkv.build import rwkv7_from_blink
from rsmem.models import DecayedSumModel

CORPUS = json.loads((Path(__file__).parents[1] / "fixtures" / "structured" / "schemas.json").read_text())


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(n_seq_max=8)


def check_json(out: RequestOutput, schema: dict[str, Any], llm: LLM) -> int:
    """Each completion: valid against ``schema`` when it stopped; when ``max_tokens`` cut it, a prefix
    a fresh matcher accepts token by token. Returns how many stopped."""
    stopped = 0
    for c in out.outputs:
        assert c.error is None
        if c.finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(c.text), schema)
            stopped += 1
        else:
            assert c.finish_reason is FinishReason.LENGTH
            assert_prefix(llm, Constraint.json_schema(schema), list(c.token_ids))
    return stopped


def assert_prefix(llm: LLM, constraint: Constraint, tokens: list[int]) -> None:
    matcher = ConstraintCompiler(llm.tokenizer, llm.context.n_vocab).compile(constraint).matcher()
    for t in tokens:
        matcher.advance(t)  # raises on a token the constraint refuses


def test_the_corpus_validates_greedy(llm: LLM) -> None:
    assert len(CORPUS) >= 50
    params = [
        SamplingParams.greedy(max_tokens=80, constraint=Constraint.json_schema(e["schema"], field=e["name"]))
        for e in CORPUS
    ]
    outs = llm.generate(["ROMEO:"] * len(CORPUS), params)
    stopped = sum(check_json(out, e["schema"], llm) for e, out in zip(CORPUS, outs, strict=True))
    assert stopped >= 40  # most answers end: the checks above are not all prefix checks


def test_the_corpus_validates_sampled_with_forks(llm: LLM) -> None:
    entries = CORPUS[::4]
    params = [
        SamplingParams(
            temperature=1.0, seed=7, n=3, max_tokens=64, constraint=Constraint.json_schema(e["schema"])
        )
        for e in entries
    ]
    outs = llm.generate(["JULIET:"] * len(entries), params)
    for e, out in zip(entries, outs, strict=True):
        assert len(out.outputs) == 3
        check_json(out, e["schema"], llm)


# small schemas: objects of typed properties, enums, bounded arrays, numbers with ranges
_names = st.text(alphabet="abcdefgh", min_size=1, max_size=6)
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(-50, 50).flatmap(
        lambda lo: st.integers(lo, lo + 100).map(lambda hi: {"type": "integer", "minimum": lo, "maximum": hi})
    ),
    st.just({"type": "number", "minimum": 0, "maximum": 1}),
    st.integers(0, 4).flatmap(
        lambda lo: st.integers(lo, lo + 8).map(
            lambda hi: {"type": "string", "minLength": lo, "maxLength": hi}
        )
    ),
    st.lists(st.text(alphabet="xyz ", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda opts: {"enum": opts}
    ),
)


def _array(items: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(items, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )


def _object(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(_names, values, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {
                "type": "object",
                "properties": props,
                "required": req,
                "additionalProperties": False,
            }
        )
    )


_schemas = st.recursive(_leaf, lambda inner: st.one_of(_array(inner), _object(inner)), max_leaves=5)


@pytest.mark.fuzz
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas, seed=st.integers(0, 1000))
def test_generated_schemas_validate(llm: LLM, schema: dict[str, Any], seed: int) -> None:
    params = SamplingParams(
        temperature=0.9, seed=seed, n=2, max_tokens=48, constraint=Constraint.json_schema(schema)
    )
    check_json(llm.generate("KING:", params)[0], schema, llm)


GBNF = r"""
root   ::= answer " " number "."
answer ::= "yes" | "no" | "maybe"
number ::= [1-9] [0-9]?
"""


@pytest.mark.parametrize(
    ("constraint", "pattern"),
    [
        (Constraint.grammar(GBNF), r"(yes|no|maybe) [1-9][0-9]?\."),
        (Constraint.regex(r"[A-Z][a-z]{1,6}, [a-z]{2,5}!"), r"[A-Z][a-z]{1,6}, [a-z]{2,5}!"),
        (Constraint.choice(["ROMEO", "JULIET", 'say "é"']), r'ROMEO|JULIET|say "é"'),
        (Constraint.lark('start: "<" NAME ">"\nNAME: /[a-z]{1,5}/'), r"<[a-z]{1,5}>"),
        (Constraint.json_object(), None),
    ],
)
def test_grammar_regex_choice_outputs_match(llm: LLM, constraint: Constraint, pattern: str | None) -> None:
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=40, constraint=constraint)
    for c in llm.generate("HAMLET:", params)[0].outputs:
        if c.finish_reason is FinishReason.LENGTH:
            assert_prefix(llm, constraint, list(c.token_ids))
            continue
        assert c.finish_reason is FinishReason.STOP
        if pattern is None:
            assert isinstance(json.loads(c.text), dict)
        else:
            assert re.fullmatch(pattern, c.text), c.text
    greedy = llm.generate("HAMLET:", SamplingParams.greedy(max_tokens=40, constraint=constraint))[0]
    if pattern is not None:
        assert greedy.outputs[0].finish_reason is FinishReason.STOP
        assert re.fullmatch(pattern, greedy.text)


def test_a_cut_answer_ends_with_length(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    out = llm.generate(
        "ROMEO:", SamplingParams.greedy(max_tokens=4, constraint=Constraint.json_schema(schema))
    )
    c = out[0].outputs[0]
    assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 4
    assert c.text.startswith('{"a"')


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (Constraint.json_schema({"not": {"type": "string"}}), "not"),
        (Constraint.json_schema({"if": {"type": "string"}, "then": {"minLength": 2}}), "if"),
        (Constraint.json_schema({"type": "string", "format": "no-such-format"}), "no-such-format"),
        (Constraint.json_schema({"$ref": "#/$defs/missing"}), "missing"),
        (Constraint.json_schema({"type": "strin"}), "strin"),
        (Constraint.grammar('root ::= "a" undefined'), "undefined"),
        (Constraint.grammar('root ::= ("a" '), "grammar"),
        (Constraint.regex("[a-"), "regex"),
        (Constraint.lark("start: nothing_here"), "nothing_here"),
    ],
)
def test_what_cannot_be_enforced_is_refused(llm: LLM, constraint: Constraint, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request("ROMEO:", SamplingParams(constraint=constraint))
    assert info.value.param == constraint.field
    assert message in str(info.value)
    assert not llm.engine.has_unfinished


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Constraint("xml", "<a/>"), "constraint"),
        (lambda: Constraint.json_schema("{not json", field="response_format"), "response_format"),
        (lambda: Constraint.json_schema("[1, 2]"), "json_schema"),
        (lambda: Constraint.choice([]), "choice"),
        (lambda: Constraint.choice(["a", ""]), "choice"),
        (lambda: Constraint.choice("ab"), "choice"),
        (lambda: Constraint.grammar("  "), "grammar"),
        (lambda: Constraint.regex("\ud800"), "regex"),
        (lambda: SamplingParams(constraint=Constraint.regex("a+"), stop=("x",)), "stop"),
        (lambda: SamplingParams(constraint='{"type": "object"}'), "constraint"),  # type: ignore[arg-type]
    ],
)
def test_malformed_constraints_name_their_field(make: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        make()
    assert info.value.param == field


def test_a_token_id_only_engine_refuses_constraints() -> None:
    with pytest.raises(InvalidRequestError, match="tokenizer") as info:
        ConstraintCompiler(None, 300).compile(Constraint.regex("a+", field="guided_regex"))
    assert info.value.param == "guided_regex"


def test_constraints_are_hashable_params() -> None:
    a = SamplingParams(constraint=Constraint.json_schema({"type": "object", "properties": {}}))
    b = SamplingParams(constraint=Constraint.json_schema({"type": "object", "properties": {}}))
    assert a == b and hash(a) == hash(b)


def test_mask_leaves_free_rows_and_the_callers_tensor_alone(llm: LLM) -> None:
    compiled = ConstraintCompiler(llm.tokenizer, llm.context.n_vocab).compile(
        Constraint.choice(["yes", "no"])
    )
    params = SamplingParams()
    free = Completion(0, torch.Generator(), None)
    bound = Completion(1, torch.Generator(), None, matcher=compiled.matcher())
    req = Request("r", [1], params, [free, bound])
    logits = torch.zeros(2, llm.context.n_vocab)
    failed: list[Any] = []
    out = mask_constrained(logits, [(req, free), (req, bound)], lambda *a, **k: failed.append(a), owned=False)
    assert not failed
    assert torch.equal(logits, torch.zeros_like(logits))  # not owned: a copy was masked
    assert torch.equal(out[0], logits[0])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed and len(allowed) < 10
    texts = {llm.tokenizer.decode([t]) for t in allowed}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


def test_a_failing_matcher_fails_its_request_alone(llm: LLM) -> None:
    engine = llm.engine
    constraint = Constraint.regex("[a-z]{60,80}")
    bad = engine.add_request("ROMEO:", SamplingParams.greedy(max_tokens=12, constraint=constraint))
    good = engine.add_request("JULIET:", SamplingParams.greedy(max_tokens=12, constraint=constraint))
    finals: dict[str, RequestOutput] = {}
    broken = False
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not broken:
            for req in engine.running:
                if req.request_id == bad and req.completions[0].tokens:
                    matcher = req.completions[0].matcher
                    assert matcher is not None
                    matcher.llmatcher.consume_token(llm.tokenizer.encode("0")[0])  # refused: an error state
                    broken = True
    assert broken
    assert finals[bad].outputs[0].finish_reason is FinishReason.ERROR
    assert "constraint" in (finals[bad].error or "")
    assert finals[good].outputs[0].finish_reason is FinishReason.LENGTH
    assert re.fullmatch("[a-z]+", finals[good].text)
    assert llm.context.memory.used == 0


def test_an_rwkv_tokenizer_constrains_too(tmp_path: Path) -> None:
    """RWKV's own tokenizer (bytes per token, greedy longest match) goes to llguidance as a token list."""
    vocab = world_vocab()
    config, tensors = rwkv7_from_blink(random_rwkv7(64, 1, len(vocab), seed=8))
    write_rwkv_gguf(tmp_path / "rwkv7.gguf", "rwkv7", config, tensors, vocab)
    llm = LLM(tmp_path / "rwkv7.gguf", n_seq_max=3)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yz"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    for constraint, check in [
        (Constraint.json_schema(schema), lambda text: jsonschema.validate(json.loads(text), schema)),
        (Constraint.choice(["Ünï", "cödé"]), lambda text: text in ("Ünï", "cödé")),
    ]:
        out = llm.generate(
            "Hello", SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=30, constraint=constraint)
        )
        for c in out[0].outputs:
            assert c.finish_reason is FinishReason.STOP
            assert check(c.text) in (None, True), c.text


def test_logits_wider_than_the_tokenizer_never_allow_the_extra_ids() -> None:
    """A model whose vocabulary is padded past its tokenizer's: the ids no token has are masked."""
    llm = LLM(
        DecayedSumModel(n_vocab=320, n_embd=6, n_layer=2, seed=3), tokenizer=byte_tokenizer(), n_seq_max=2
    )
    params = SamplingParams(
        temperature=1.5, seed=4, n=2, max_tokens=12, constraint=Constraint.regex("[a-c]{3,6}")
    )
    for c in llm.generate("abc", params)[0].outputs:
        assert all(t < 257 for t in c.token_ids)
        assert c.finish_reason is FinishReason.LENGTH or re.fullmatch("[a-c]{3,6}", c.text)


def greedy_run(engine: Engine, prompt: str | list[int], params: SamplingParams, **kw: Any) -> RequestOutput:
    rid = engine.add_request(prompt, params, **kw)
    return next(out for out in engine.run_until_done() if out.request_id == rid and out.finished)


def greedy_tokens(engine: Engine, prompt: str | list[int], params: SamplingParams, **kw: Any) -> list[int]:
    return list(greedy_run(engine, prompt, params, **kw).outputs[0].token_ids)


def test_forced_runs_go_in_one_chunk_and_change_nothing() -> None:
    """Tokens the constraint forces are appended without sampling and fed with the next step's token
    (for a completion decoding alone): fewer steps, the same greedy answers."""
    entries = CORPUS[:12]
    texts, steps = [], []
    for forced in (True, False):
        llm = LLM(n_seq_max=1)
        if not forced:
            llm.engine.builder.constraints.forced_run = 0
        answers = []
        for e in entries:
            params = SamplingParams.greedy(max_tokens=48, constraint=Constraint.json_schema(e["schema"]))
            answers.append(llm.generate("ROMEO:", params)[0].text)
        texts.append(answers)
        steps.append(llm.engine.stats.steps)
    assert texts[0] == texts[1]
    assert steps[0] < 0.7 * steps[1]


def test_no_forced_runs_in_a_batch() -> None:
    """Two completions decoding together sample every token (a run would split their step)."""
    llm = LLM(n_seq_max=2)
    constraint = Constraint.choice(["MERCUTIO and the Nurse, with TYBALT"])
    out = llm.generate("ROMEO:", SamplingParams.greedy(n=2, max_tokens=40, constraint=constraint))[0]
    assert [c.text for c in out.outputs] == ["MERCUTIO and the Nurse, with TYBALT"] * 2
    assert llm.engine.stats.steps == len(out.outputs[0].token_ids)  # the prompt's step, then one a token


@pytest.mark.parametrize("kept", ["session", "prompt_cache"])
def test_a_forced_run_at_the_end_is_not_counted_in_the_state(kept: str) -> None:
    """A constraint that ends inside a forced run leaves those tokens unfed: a session feeds them with
    its next prompt, the prompt cache keys the state by what it folded. Both continue as a fresh run."""
    constraint = Constraint.choice(["MERCUTIO and the Nurse, with TYBALT"])
    follow = SamplingParams.greedy(max_tokens=12)
    model = LLM().model
    engine = Engine(Context(model, n_seq_max=2), LLM().tokenizer, prompt_cache=kept == "prompt_cache")
    first = SamplingParams.greedy(max_tokens=40, constraint=constraint)
    if kept == "session":
        session = engine.open_session()
        answer = greedy_tokens(engine, "ROMEO:", first, session=session)
        assert len(answer) > 2 and session.pending == answer[-len(session.pending) :]
        assert len(session.pending) > 1  # the forced run waits with the last token
        then = greedy_tokens(engine, " Exeunt.", follow, session=session)
    else:
        answer = greedy_tokens(engine, "ROMEO:", first)
        tok = engine.tokenizer
        assert tok is not None
        out = greedy_run(engine, tok.encode("ROMEO:") + answer + tok.encode(" Exeunt."), follow)
        # one choice: every token after the first is forced, so the state folded the prompt alone
        assert out.num_cached_tokens == len(tok.encode("ROMEO:"))
        then = list(out.outputs[0].token_ids)
    fresh = Engine(Context(model, n_seq_max=1), engine.tokenizer)
    tok = fresh.tokenizer
    assert tok is not None
    assert then == greedy_tokens(fresh, tok.encode("ROMEO:") + answer + tok.encode(" Exeunt."), follow)


@pytest.mark.parametrize("name", ["lfm2", "nemotron_h", "qwen35"])
def test_forced_runs_through_a_hybrid_memory(name: str) -> None:
    """A hybrid's attention layers take a forced run as a chunk too (split into micro-batches of 16):
    the same greedy answers as one token a step."""
    model = load_model(Path(__file__).parents[1] / "fixtures" / "llamacpp" / name / "model-f32.gguf")
    schema = {"type": "object", "properties": {"abc": {"enum": ["x", "yy"]}}, "required": ["abc"]}
    constraints = [Constraint.json_schema(schema), Constraint.choice(["a long forced answer, spelled out"])]
    answers = []
    for forced in (True, False):
        engine = Engine(Context(model, n_seq_max=2, n_batch=64, n_ubatch=16, n_ctx=1024), byte_tokenizer())
        if not forced:
            engine.builder.constraints.forced_run = 0
        answers.append(
            [
                greedy_tokens(engine, "ab", SamplingParams.greedy(max_tokens=40, constraint=c))
                for c in constraints
            ]
        )
    assert answers[0] == answers[1]
    assert bytes(answers[0][1]).decode() == "a long forced answer, spelled out"
