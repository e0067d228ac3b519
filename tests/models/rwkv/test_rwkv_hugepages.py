"""RWKV's float32 matrices and head are held on one huge-page mapping (rsmem.hugepages), with the loader's
values, as the Mamba and hybrid models hold theirs; with RSMEM_HUGEPAGES=0 the model is the same."""

from __future__ import annotations

import pytest
import torch

from helpers.rwkv_reference import random_rwkv7
from rsmem import Batch, Context, hugepages
from rsmem.loaders.rwkv.build import build_rwkv, rwkv7_from_blink
from rsmem.loaders.tensors import ModelTensors

needs_mapping = pytest.mark.skipif(
    not hugepages._enabled() or hugepages._arena([((1,), torch.uint8)]) is None,
    reason="no huge-page mappings on this platform",
)


def _build(sd: dict[str, torch.Tensor]):
    config, tensors = rwkv7_from_blink(sd)
    return build_rwkv(ModelTensors(arch="rwkv7", config=config, tensors=tensors))


def _plain(weight_t: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` matrix a held ``[in, out]`` view shows."""
    return weight_t.t()


@needs_mapping
def test_matrices_and_head_share_one_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    # a head of 16,000 x 256 float32 puts the matrices above hugepages.MIN_BYTES
    sd = random_rwkv7(n_embd=256, n_layer=2, n_vocab=16000, seed=3)
    model = _build(sd)
    head = _plain(model.lm_head)
    assert head.is_contiguous() and head.data_ptr() % hugepages.HUGE_PAGE == 0  # the arena's first tensor
    torch.testing.assert_close(head, sd["head.weight"], rtol=0, atol=0)
    names = {"receptance": "att.receptance", "key": "att.key", "ffn_key": "ffn.key", "ffn_value": "ffn.value"}
    span = head.data_ptr() + head.nbytes
    for il, layer in enumerate(model.layers):
        for field, blink in names.items():
            w = _plain(getattr(layer, field))
            assert w.data_ptr() % hugepages.ALIGN == 0 and head.data_ptr() < w.data_ptr()
            torch.testing.assert_close(w, sd[f"blocks.{il}.{blink}.weight"], rtol=0, atol=0)
            span = max(span, w.data_ptr() + w.nbytes)
    total = sum(m.nbytes for m in (head, *(getattr(ly, n) for ly in model.layers for n in model.matrices)))
    assert span - head.data_ptr() < total + hugepages.ALIGN * (1 + len(model.layers) * len(model.matrices))

    monkeypatch.setenv("RSMEM_HUGEPAGES", "0")
    plain = _build(sd)
    prompt = [5, 17, 250, 3, 99, 1000, 15999]
    got, want = Context(model), Context(plain)
    for ctx in (got, want):
        ctx.decode(Batch(prompt, logits=[True] * len(prompt)))
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
