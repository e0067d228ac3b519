"""The one-sequence RWKV decode step's big products through the C++ few-row kernel
(:func:`rsmem.models.step.wkv_fused.one_row` with :meth:`~rsmem.models.rwkv.base.RwkvModelBase.one_operand`):
the kernel's operand when the kernels are loaded, inductor's fused reduction (``[out, in]`` rows) when not;
the same products and the same compiled steps either way (against the eager models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.models.step import small_rows
from rsmem.models.step.compiled import has_cxx_compiler
from rsmem.models.step.small_rows import SmallRows
from rsmem.models.step.wkv_fused import one_row
from rsmem.models.step.wkv_many import MANY_OPTIONS

pytestmark = pytest.mark.compiled

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "rwkv"
needs_kernels = pytest.mark.skipif(small_rows.kernel_ops() is None, reason="the C++ kernels are not built")
needs_compiler = pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")


@needs_kernels
@pytest.mark.parametrize(("n_out", "n_in"), [(768, 768), (300, 128), (5, 1000)])
def test_one_row_kernel_matches_the_reduction(n_out: int, n_in: int) -> None:
    g = torch.Generator().manual_seed(n_out)
    w = torch.randn(n_out, n_in, generator=g)
    x = torch.randn(1, n_in, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    got = one_row(x, SmallRows(w, packed, small_rows.MAX_ROWS))
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(one_row(x, w), x @ w.t(), rtol=1e-5, atol=1e-4)


@needs_kernels
@needs_compiler
def test_one_operand_takes_the_kernel_when_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    model = rsmem.load_model(FIXTURES / "rwkv7" / "model-f32.gguf", compile=True)
    weight_t = model.layers[0].key
    got = model.one_operand(weight_t)
    assert isinstance(got, SmallRows) and got.plain.data_ptr() == weight_t.data_ptr()  # no copy
    assert model.one_options() == MANY_OPTIONS  # the glue on one thread
    monkeypatch.setattr(small_rows, "kernel_ops", lambda: None)
    plain = rsmem.load_model(FIXTURES / "rwkv7" / "model-f32.gguf", compile=True)
    view = plain.one_operand(plain.layers[0].key)
    assert isinstance(view, torch.Tensor) and view.shape == plain.layers[0].key.t().shape
    assert plain.one_options() is None


@needs_compiler
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_compiled_step_without_the_kernels_matches_eager(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels absent the one-sequence step keeps inductor's reductions (tests/models/rwkv/
    test_rwkv_compiled.py runs the kernel's route where they are built): the eager model's logits."""
    eager = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    monkeypatch.setattr(small_rows, "kernel_ops", lambda: None)
    compiled = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=True)
    assert isinstance(compiled.one_operand(compiled.lm_head), torch.Tensor)
    contexts = [Context(m) for m in (eager, compiled)]
    for ctx in contexts:
        ctx.decode(Batch(list(range(1, 9))))
    for tok in (5, 261, 17):
        outs = []
        for ctx in contexts:
            ctx.decode(Batch([tok]))
            outs.append(ctx.get_logits(-1))
        assert outs[0].abs().max() > 0
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
