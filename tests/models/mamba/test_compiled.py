"""The compiled decode path (models.compiled, ops.fused): same results as the eager path, a safe fallback
when compiling fails, and the auto policy."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import context as context_module
from rsmem import threads
from rsmem.models.mamba.mamba1 import MambaConfig
from rsmem.models.mamba.mamba2 import Mamba2Config
from rsmem.models.mamba.random_init import random_mamba, random_mamba2
from rsmem.models.ops import wkv, wkv6
from rsmem.models.step import compiled, fused
from rsmem.models.step import native as native_step
from rsmem.models.step.compiled import (
    AUTO_MIN_WEIGHTS,
    GLUE_MIN_CHUNK,
    ONE_THREAD_GLUE,
    CompiledStep,
    resolve_compile,
)
from rsmem.models.step.fused import SmallRows
from rsmem.models.step.packed import packing_enabled
from rsmem.models.step.small_rows import kernel_ops

pytestmark = pytest.mark.compiled

CPU = torch.device("cpu")
RWKV_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "rwkv"
needs_cxx = pytest.mark.skipif(not compiled.has_cxx_compiler(), reason="inductor needs a C++ compiler")


def _model(arch: str):
    if arch == "mamba":
        return random_mamba(MambaConfig(d_model=32, n_layer=2, n_vocab=64, d_state=8, dt_rank=4), seed=3)
    return random_mamba2(
        Mamba2Config(d_model=32, n_layer=2, n_vocab=64, d_state=8, n_head=4, n_group=2, chunk_size=4), seed=3
    )


def _run(model, compile_decode: bool) -> list[torch.Tensor]:
    """Prefill two sequences, fork one, then decode 1 sequence alone and 3 together; every step's logits."""
    model.set_compile(compile_decode)
    ctx = rsmem.Context(model, n_seq_max=4)
    out = []
    ctx.decode(rsmem.Batch([1, 2, 3, 4, 5, 6], seq_ids=[[0]] * 3 + [[1]] * 3))
    ctx.memory.seq_cp(1, 2, -1, -1)
    for k in range(4):  # one sequence a step
        ctx.decode(rsmem.Batch([7 + k], seq_ids=[[0]]))
        out.append(ctx.logits.clone())
    for k in range(4):  # three sequences a step, one of them the fork
        ctx.decode(rsmem.Batch([11 + k, 20 + k, 30 + k], seq_ids=[[0], [1], [2]], logits=[True] * 3))
        out.append(ctx.logits.clone())
    return out + [t.clone() for t in (*ctx.memory.r_l, *ctx.memory.s_l)]  # the states, each layer's rows


@needs_cxx
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_compiled_decode_matches_eager(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")  # Mamba-2's one sequence: its C++ step has its own tests
    model = _model(arch)
    eager = _run(model, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile failure would fall back silently
        got = _run(model, True)
    assert model.compile_decode
    steps = [v for k, v in vars(model).items() if isinstance(v, CompiledStep)]
    assert model._token_step_one._checked and all(s.failed is None for s in steps)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_fused_steps_match_the_model_ops_eagerly() -> None:
    """The fused one-token Mamba-2 mixer against the chunked SSD kernel and the conv it replaces."""
    from rsmem.models.ops.conv import causal_conv1d
    from rsmem.models.ops.norm import gated_group_rms_norm
    from rsmem.models.ops.ssd import ssd_chunked

    g = torch.Generator().manual_seed(0)
    n_seqs, n_head, head_dim, d_state, n_group, k = 3, 4, 8, 16, 2, 4
    d_inner = n_head * head_dim
    conv_dim = d_inner + 2 * n_group * d_state
    zxbcdt = torch.randn(n_seqs, d_inner + conv_dim + n_head, generator=g)
    window = torch.randn(n_seqs, conv_dim, k - 1, generator=g)
    conv_w, conv_b = torch.randn(conv_dim, k, generator=g), torch.randn(conv_dim, generator=g)
    dt_bias, D = torch.randn(n_head, generator=g), torch.randn(n_head, generator=g)
    A = -torch.rand(n_head, generator=g) * 4
    ssm_norm = torch.randn(d_inner, generator=g)
    h = torch.randn(n_seqs, n_head, head_dim, d_state, generator=g)

    z, xBC, dt = zxbcdt.split([d_inner, conv_dim, n_head], dim=-1)
    xBC_c, window_want = causal_conv1d(xBC.unsqueeze(1), window, conv_w, conv_b)
    x, B, C = torch.nn.functional.silu(xBC_c[:, 0]).split([d_inner, n_group * d_state, n_group * d_state], -1)
    y, h_want = ssd_chunked(
        x.reshape(n_seqs, 1, n_head, head_dim),
        torch.nn.functional.softplus(dt + dt_bias).unsqueeze(1),
        A,
        B.reshape(n_seqs, 1, n_group, d_state),
        C.reshape(n_seqs, 1, n_group, d_state),
        D,
        h,
    )
    want = gated_group_rms_norm(y.reshape(n_seqs, d_inner), z, ssm_norm, n_group, 1e-5)
    got = fused.mamba2_mixer_step_(zxbcdt, window, conv_w, conv_b, dt_bias, A, D, ssm_norm, h, n_group, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window, window_want)
    torch.testing.assert_close(h, h_want, rtol=1e-5, atol=1e-5)


def test_failed_compile_falls_back_before_touching_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling is tried on stand-ins for the written and batch arguments first: when it fails the eager
    function runs and the real state is changed once, by the eager run only. Read-only arguments (weights)
    are passed as they are, never copied."""
    seen: list[tuple[int, ...]] = []

    def broken_compile(fn, **kwargs):
        def run(*args):
            seen.append(tuple(id(a) for a in args))
            args[1].add_(100.0)  # a failure after writing to the state it updates
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(compiled.torch, "compile", broken_compile)
    step = CompiledStep(fused.conv_step_, batch_args=(0,), mutated=(1,))
    x, window = torch.randn(2, 6), torch.randn(2, 6, 3)
    w, b = torch.randn(6, 4), torch.randn(6)
    want_window = window.clone()
    want = fused.conv_step_(x.clone(), want_window, w, b)
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        got = step(x, window, w, b)
    assert step.failed is not None
    assert seen[0][2:] == (id(w), id(b)) and id(x) not in seen[0] and id(window) not in seen[0]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(window, want_window)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x, window, w, b)  # later calls go straight to the eager function, with no new warning


def test_auto_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: True)
    assert resolve_compile("auto", AUTO_MIN_WEIGHTS, CPU)
    assert not resolve_compile("auto", AUTO_MIN_WEIGHTS - 1, CPU)
    assert resolve_compile(True, 10, CPU) and resolve_compile("1", 10, CPU)
    assert not resolve_compile(False, AUTO_MIN_WEIGHTS, CPU)
    assert not resolve_compile("0", AUTO_MIN_WEIGHTS, CPU)
    monkeypatch.setenv("RSMEM_COMPILE", "0")
    assert not resolve_compile(None, AUTO_MIN_WEIGHTS, CPU)
    monkeypatch.setenv("RSMEM_COMPILE", "1")
    assert resolve_compile(None, 10, CPU)
    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: False)
    assert not resolve_compile("auto", AUTO_MIN_WEIGHTS, CPU)
    with pytest.raises(ValueError, match="auto, 1 or 0"):
        resolve_compile("sometimes", 10, CPU)


def test_small_models_decode_eagerly_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RSMEM_COMPILE", raising=False)
    assert not _model("mamba2").compile_decode


@pytest.mark.parametrize("n_tokens", [1, 16, 37])
def test_blocked_scan_matches_reference(n_tokens: int) -> None:
    """The block-wise sequential scan (eager here) against the token loop, with decays strong enough to
    cut the chunked scan's chunks short, and a padded last block that must leave the state as it is."""
    from rsmem.models.ops.selective_scan import selective_scan_ref

    g = torch.Generator().manual_seed(4)
    n_seqs, d, n = 2, 12, 5
    x = torch.randn(n_seqs, n_tokens, d, generator=g)
    dt = torch.rand(n_seqs, n_tokens, d, generator=g) * 3
    A = -torch.rand(d, n, generator=g) * 16
    B, C = torch.randn(n_seqs, n_tokens, n, generator=g), torch.randn(n_seqs, n_tokens, n, generator=g)
    D, h = torch.randn(d, generator=g), torch.randn(n_seqs, d, n, generator=g)
    y_want, h_want = selective_scan_ref(x, dt, A, B, C, D, h.clone())
    y = fused.selective_scan_blocked_(x, dt, A, B, C, D, h)
    torch.testing.assert_close(y, y_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_want, rtol=1e-5, atol=1e-5)


@needs_cxx
def test_warm_up_compiles_every_variant_without_touching_state() -> None:
    model = _model("mamba")
    assert model.warm_up() == 0.0  # not compiling: nothing to do
    model.set_compile(True)
    assert model.warm_up() > 0.0
    steps = [v for v in vars(model).values() if isinstance(v, CompiledStep)]
    # one sequence (and up to MAX_ROWS) decodes through the C++ step where the kernels are loaded (checked
    # at its first call); a decode of more sequences compiled the batched step
    native = model._native is not None and model._native._checked and model._native.failed is None
    assert native == (model._native is not None and model._native.usable())
    assert steps and all(
        s._checked and s.failed is None for s in steps if not (native and s is model._token_step_one)
    )


@pytest.fixture
def busy_neighbour(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The automatic thread count on sleeping threads, with another process's thread runnable (as
    tests/runtime/test_threads.py's fixture of the same name)."""
    monkeypatch.setattr(threads, "_auto_count", True)
    monkeypatch.setattr(threads, "_PASSIVE", True)
    monkeypatch.setattr(threads, "others_runnable", lambda path=threads.LOADAVG: 1)
    monkeypatch.delenv("RSMEM_BUSY_THREADS", raising=False)
    torch.set_num_threads(threads.all_cores())
    return monkeypatch


@pytest.fixture
def prompt_thread_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread counts at which ``Context.decode``'s prompt_threads blocks ran, appended as they run."""
    counts: list[int] = []
    raise_threads = threads.prompt_threads

    @contextmanager
    def spy(tokens_per_seq: int) -> Iterator[None]:
        with raise_threads(tokens_per_seq):
            counts.append(torch.get_num_threads())
            yield

    monkeypatch.setattr(context_module, "prompt_threads", spy)
    return counts


@needs_cxx
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
@pytest.mark.usefixtures("busy_neighbour")
def test_no_recompiles_after_warm_up(arch: str, prompt_thread_counts: list[int]) -> None:
    """Prompt lengths and batch widths vary in a server: after warm_up nothing may compile again. Dynamo's
    compilations are kept per function, across models: the process starts afresh, as a server's would
    (earlier tests' models of other shapes left entries that this model's calls can miss). Beside a busy
    process, where prompts of ``PROMPT_TOKENS`` or more run at a raised thread count (dynamo guards on the
    count): that is how this test failed now and then in CI, when another thread was runnable at its
    33-token prompts."""
    torch._dynamo.reset()
    model = _model(arch)
    model.set_compile(True)
    model.warm_up()
    wide = native_step.MAX_ROWS + 1  # more than the C++ step takes: the compiled batched step
    ctx = rsmem.Context(model, n_seq_max=wide, n_batch=256)
    assert threads.PROMPT_TOKENS <= 33
    with torch.compiler.set_stance("fail_on_recompile"):
        for n_tokens in (5, 17, 33):
            ctx.memory.clear()
            ctx.decode(rsmem.Batch([3] * n_tokens, seq_ids=[[0]] * n_tokens))
            ctx.decode(rsmem.Batch([4] * (2 * n_tokens), seq_ids=[[1]] * n_tokens + [[2]] * n_tokens))
        for width in (1, 2, 3, 5, wide):
            ctx.decode(rsmem.Batch([5] * width, seq_ids=[[s] for s in range(width)], logits=[True] * width))
    assert 2 * threads.all_cores() in prompt_thread_counts  # the 33-token prompts ran at the raised count


@needs_cxx
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_rwkv_compiled_prefill_does_not_compile_again_beside_a_busy_process(
    arch: str, busy_neighbour: pytest.MonkeyPatch, prompt_thread_counts: list[int]
) -> None:
    """RWKV's compiled chunk solves (the chunked WKV kernel, where the C++ scan is not loaded) inside a
    prompt at the raised thread count run at the count they were compiled at: a prompt after a quiet one
    compiles nothing again, and its logits are the quiet prompt's."""
    for module in (wkv, wkv6):  # the chunked kernel with compiled chunk solves, not the C++ scan
        busy_neighbour.setattr(module, "scan_ops", lambda *tensors: None)
    torch._dynamo.reset()
    model = rsmem.load_model(RWKV_FIXTURES / arch / "model-f32.gguf", compile=True)
    ctx = rsmem.Context(model, n_seq_max=2)
    prompt = [(7 * i) % 299 + 1 for i in range(40)]
    with busy_neighbour.context() as quiet:
        quiet.setattr(threads, "others_runnable", lambda path=threads.LOADAVG: 0)
        ctx.decode(rsmem.Batch(prompt, seq_ids=[[0]] * len(prompt)))  # compiles the chunk solves
    first = ctx.get_logits(-1).clone()
    with torch.compiler.set_stance("fail_on_recompile"):
        ctx.decode(rsmem.Batch(prompt, seq_ids=[[1]] * len(prompt)))
    assert prompt_thread_counts == [threads.all_cores(), 2 * threads.all_cores()]
    assert model.wkv_intra is not None and model.wkv_intra._checked and model.wkv_intra.failed is None
    assert first.abs().max() > 0
    torch.testing.assert_close(ctx.get_logits(-1), first, rtol=0, atol=1e-5)


@needs_cxx
@pytest.mark.parametrize(("arch", "threshold"), [("mamba2", GLUE_MIN_CHUNK), ("mamba", None)])
def test_mamba2_steps_keep_their_glue_on_one_thread(arch: str, threshold: int | None) -> None:
    """Mamba-2's batched step compiles with the hybrids' glue threshold: small elementwise kernels run
    where they are instead of handing a few thousand elements to another thread (on a shared machine that
    thread waits for a core). Mamba keeps inductor's default (its batched scan kernels were slower on one).
    The one-sequence step of either streams its products through the few-row kernel (rsmem's workers) and
    keeps every inductor kernel on the calling thread."""
    model = _model(arch)
    model.set_compile(True)
    assert model._token_step_many.options.get("cpp.min_chunk_size") == threshold
    head = model._step_args[0][1]
    assert isinstance(head, SmallRows) == (kernel_ops() is not None)
    one = ONE_THREAD_GLUE["cpp.min_chunk_size"] if isinstance(head, SmallRows) else threshold
    assert model._token_step_one.options.get("cpp.min_chunk_size") == one


def test_bf16_single_sequence_stays_eager() -> None:
    """bf16 matrices are held [in, out]: the one-row compiled step would stream them across rows, so a
    single sequence decodes eagerly (several still use the compiled mixer)."""
    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=64, d_state=8, n_head=4, n_group=2)
    logits = {}
    for compile_decode in (False, True):
        bf16 = random_mamba2(cfg, seed=3, dtype=torch.bfloat16)
        bf16.set_compile(compile_decode)
        ctx = rsmem.Context(bf16, n_seq_max=2)
        ctx.decode(rsmem.Batch([1, 2, 3, 4], seq_ids=[[0], [0], [1], [1]]))
        ctx.decode(rsmem.Batch([5], seq_ids=[[0]]))
        ctx.decode(rsmem.Batch([6, 7], seq_ids=[[0], [1]], logits=[True, True]))  # the compiled mixer
        logits[compile_decode] = ctx.logits
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-4)
    assert not bf16._token_step_one._checked and bf16._token_step_many._checked
    assert not bf16._rows_contiguous
    assert _model("mamba2")._rows_contiguous == packing_enabled()  # f32 with packing: held [out, in]


@needs_cxx
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_engine_with_compiled_steps_generates_what_eager_does(arch: str) -> None:
    """Continuous batching (chunked prefills next to decodes of changing width) through compiled steps."""
    import random

    from rsmem.engine import Engine, SamplingParams

    rng = random.Random(5)
    requests = [
        ([rng.randrange(64) for _ in range(rng.randrange(1, 30))], rng.randrange(2, 9)) for _ in range(8)
    ]

    def run(compile_decode: bool) -> list[tuple[int, ...]]:
        model = _model(arch)
        model.set_compile(compile_decode)
        engine = Engine(rsmem.Context(model, n_seq_max=4, n_batch=64, n_ubatch=16), None, max_batch_tokens=24)
        ids = [engine.add_request(p, SamplingParams.greedy(max_tokens=n)) for p, n in requests]
        final = {o.request_id: o for o in engine.run_until_done() if o.finished}
        return [final[i].outputs[0].token_ids for i in ids]

    assert run(True) == run(False)
