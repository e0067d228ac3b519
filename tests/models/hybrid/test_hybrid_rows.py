"""Several sequences' products of the hybrids through the C++ few-row kernel
(:func:`rsmem.models.hybrid.layers.many_operand`, :func:`~rsmem.models.hybrid.layers.many_head`, the
``*_many`` blocks of models/step/hybrid_fused.py): the kernel's operand when the kernels are loaded, oneDNN's
packed twin when not, ``[out, in]`` rows without a twin; the same products either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rsmem
from rsmem.models.hybrid.layers import many_head, many_operand
from rsmem.models.step import small_rows
from rsmem.models.step.fused import Packed, mamba2_layer_many_
from rsmem.models.step.packed import HeldMatrices
from rsmem.models.step.small_rows import SmallRows

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
needs_kernels = pytest.mark.skipif(
    small_rows.kernel_ops() is None, reason="the C++ kernels are not built here"
)


@needs_kernels
def test_many_operand_takes_the_kernel_when_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    model = rsmem.load_model(FIXTURES / "lfm2" / "model-f32.gguf", compile=False)
    weight_t = model.layers[0].ffn_down
    assert weight_t is not None
    got = many_operand(model.held, weight_t)
    assert isinstance(got, SmallRows) and got.plain.data_ptr() == weight_t.data_ptr()  # no copy
    monkeypatch.setattr(small_rows, "kernel_ops", lambda: None)
    assert isinstance(many_operand(model.held, weight_t), Packed)


def test_many_operand_without_a_twin_is_the_rows() -> None:
    model = rsmem.load_model(FIXTURES / "lfm2" / "model-f32.gguf", dtype=torch.bfloat16, compile=False)
    weight_t = model.layers[0].ffn_down
    assert weight_t is not None and model.held.packed.twin(weight_t) is None
    got = many_operand(model.held, weight_t)
    assert isinstance(got, torch.Tensor) and got.shape == weight_t.t().shape


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("n_rows", [3, 8, 20])  # 20: beyond the kernel's rows, oneDNN inside the same op
def test_many_head_matches_the_held_product(
    kernels: bool, n_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(small_rows, "kernel_ops", lambda: None)
    model = rsmem.load_model(FIXTURES / "qwen35" / "model-f32.gguf", compile=False)
    rows = torch.randn(n_rows, model.lm_head.shape[0], generator=torch.Generator().manual_seed(n_rows))
    want = model.held.linear(rows, model.lm_head)
    torch.testing.assert_close(many_head(model.held, rows, model.lm_head), want, rtol=0, atol=2e-5)


def test_nemotron_mamba2_block_through_rows_matches_the_packed_one() -> None:
    """Nemotron-H's Mamba-2 block for several sequences (fused.mamba2_layer_many_) with the few-row operands
    against the same block with oneDNN's packed ones, eagerly, state rows included."""
    model = rsmem.load_model(FIXTURES / "nemotron_h" / "model-f32.gguf", compile=False)
    cfg = model.config
    il = next(i for i in range(cfg.n_layer) if model.is_recurrent_layer(i))
    ly, mx = model.layers[il], model.layers[il].mixer
    assert mx is not None
    gen = torch.Generator().manual_seed(0)
    n = 5
    x = torch.randn(n, cfg.d_model, generator=gen)
    window = torch.randn(n, cfg.conv_dim, cfg.d_conv - 1, generator=gen)
    h = torch.randn(n, cfg.n_ssm_head, cfg.ssm_head_dim, cfg.d_state, generator=gen)
    outs = []
    for operand in (many_operand, _packed):
        w, s = window.clone(), h.clone()
        y = mamba2_layer_many_(
            x, ly.norm, operand(model.held, mx.in_proj), mx.conv_weight, mx.conv_bias, mx.dt_bias, mx.A, mx.D,
            mx.ssm_norm, operand(model.held, mx.out_proj), w, s, cfg.n_group, cfg.eps,
        )  # fmt: skip
        outs.append((y, w, s))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def _packed(held: HeldMatrices, weight_t: torch.Tensor) -> Packed:
    twin = held.packed.twin(weight_t)
    assert twin is not None
    return Packed(twin)
