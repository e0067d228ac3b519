"""RWKV models under the engine, unchanged: prompts batched together generate what each generates alone,
``n = 2`` forks the prompt's state, and the prefix cache's checkpoints (rows of the recurrent memory) serve a
regenerate and a shared prefix with the same text as computing everything."""

from __future__ import annotations

import pytest

from helpers.rwkv_reference import random_rwkv6, random_rwkv7, world_vocab, write_rwkv_gguf
from rsmem import Context, SamplingParams
from rsmem.engine import Engine, TextTokenizer
from rsmem.engine.llm import load_text_model
from rsmem.loaders.rwkv.build import rwkv7_from_blink
from rsmem.loaders.rwkv.rwkv6 import rwkv6_from_blink

PROMPTS = ["Hello there", "The cat sat on the mat and", "Ünïcödé ok", "x"]


@pytest.fixture(scope="module", params=["rwkv7", "rwkv6"])
def loaded(request, tmp_path_factory) -> tuple[object, TextTokenizer]:
    arch = request.param
    if arch == "rwkv7":
        config, tensors = rwkv7_from_blink(random_rwkv7(128, 2, 300, seed=8))
    else:
        config, tensors = rwkv6_from_blink(random_rwkv6(128, 2, 300, seed=8))
    path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
    write_rwkv_gguf(path, arch, config, tensors, world_vocab())
    model, tok = load_text_model(path)
    assert tok is not None
    return model, tok


def run(engine: Engine, prompts: list[str], params: SamplingParams) -> list[list[str]]:
    ids = engine.add_requests(prompts, params)
    done = {out.request_id: out for out in engine.run_until_done() if out.finished}
    return [[c.text for c in done[i].outputs] for i in ids]


def test_batched_equals_alone_and_forks(loaded) -> None:
    model, tok = loaded
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = run(Engine(Context(model, n_seq_max=4), tok), PROMPTS, greedy)
    alone = [run(Engine(Context(model, n_seq_max=1), tok), [p], greedy)[0] for p in PROMPTS]
    assert together == alone
    assert all(t[0] for t in together)
    # n = 2 forks the prompt state (seq_cp): with a seed, each completion equals the seeded single sampling
    sampled = SamplingParams(temperature=0.9, max_tokens=6, seed=3, n=2, ignore_eos=True)
    pair = run(Engine(Context(model, n_seq_max=2), tok), [PROMPTS[1]], sampled)[0]
    assert len(pair) == 2 and all(pair)


def test_prefix_cache_checkpoints_serve_the_same_text(loaded) -> None:
    model, tok = loaded
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    system = "You are a helpful assistant. " * 3
    prompts = [
        system + "First question?",
        system + "Second one?",
        system + "Third?",
        system + "First question?",
    ]
    plain = [run(Engine(Context(model, n_seq_max=1), tok), [p], greedy)[0] for p in prompts]
    engine = Engine(Context(model, n_seq_max=2), tok, cache_bytes=64 << 20, prompt_cache=True)
    cached, hits = [], []
    for p in prompts:
        rid = engine.add_request(p, greedy)
        out = [o for o in engine.run_until_done() if o.finished and o.request_id == rid][0]
        cached.append([c.text for c in out.outputs])
        hits.append(out.num_cached_tokens)
    assert cached == plain
    n_system = len(tok.encode(system))
    # the second prompt left the first's tokens after the system prompt: a checkpoint there serves the third;
    # the fourth repeats the first (its checkpoint before the last token, or a kept slot)
    assert hits[0] == hits[1] == 0
    assert n_system - 1 <= hits[2] <= n_system + 1
    assert hits[3] >= len(tok.encode(prompts[3])) - 1


def test_cache_dir_serves_a_restarted_engine(loaded, tmp_path) -> None:
    """Checkpoints written to ``cache_dir`` (files keyed by the model's fingerprint, which samples the RWKV
    matrices too) serve a new engine on the same model."""
    model, tok = loaded
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = "A prompt long enough to be worth keeping, " * 2

    def once() -> tuple[list[str], int]:
        engine = Engine(Context(model, n_seq_max=1), tok, cache_bytes=64 << 20, cache_dir=tmp_path)
        rid = engine.add_request(prompt, greedy)
        out = [o for o in engine.run_until_done() if o.finished and o.request_id == rid][0]
        return [c.text for c in out.outputs], out.num_cached_tokens

    first, hits_first = once()
    second, hits_second = once()
    assert first == second and hits_first == 0
    assert hits_second >= len(tok.encode(prompt)) - 1
