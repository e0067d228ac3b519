"""rsmem.hugepages: copies equal the originals, share one mapping, and small sets stay as they are."""

from __future__ import annotations

import pytest
import torch

from rsmem import hugepages
from rsmem.hugepages import huge_page_copies

# madvise(MADV_HUGEPAGE) fails on kernels built without transparent huge pages: rsmem then falls back
needs_mapping = pytest.mark.skipif(
    not hugepages._enabled() or hugepages._arena([((1,), torch.uint8)]) is None,
    reason="no huge-page mappings on this platform",
)


@needs_mapping
def test_copies_are_equal_contiguous_and_aligned() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1 << 20, generator=g), torch.randn(3, 5, generator=g), torch.randn(2048, 2048)]
    tensors.append(torch.randn(7, dtype=torch.float64, generator=g))
    copies = huge_page_copies(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert c.data_ptr() != t.data_ptr() and c.is_contiguous()
        assert c.data_ptr() % hugepages.ALIGN == 0
        torch.testing.assert_close(c, t, rtol=0, atol=0)
    assert copies[0].data_ptr() % hugepages.HUGE_PAGE == 0  # the arena starts on a huge page
    copies[1].add_(1.0)  # writable, and independent of the original
    torch.testing.assert_close(copies[1], tensors[1] + 1.0)


def test_small_or_disabled_sets_are_returned_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    small = [torch.zeros(10), torch.ones(3, 3)]
    assert all(c is t for c, t in zip(huge_page_copies(small), small, strict=True))
    big = [torch.zeros(hugepages.MIN_BYTES // 4)]
    monkeypatch.setenv("RSMEM_HUGEPAGES", "0")
    assert huge_page_copies(big)[0] is big[0]
    strided = [torch.zeros(hugepages.MIN_BYTES // 4 // 8, 8).t()]
    monkeypatch.delenv("RSMEM_HUGEPAGES")
    assert huge_page_copies(strided)[0] is strided[0]  # only contiguous tensors are moved


@needs_mapping
def test_matrices_keep_their_layout_and_views_share_one_copy() -> None:
    from rsmem.hugepages import huge_page_matrices

    g = torch.Generator().manual_seed(1)
    embedding = torch.randn(4096, 1024, generator=g)  # 16 MiB: enough for a mapping on its own
    out_in = torch.randn(512, 256, generator=g)
    half = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    strided = torch.randn(64, 128, generator=g)[:, ::2]
    items = [embedding, embedding.t(), out_in.t(), None, half, strided, out_in]
    moved = huge_page_matrices(items)
    emb, head, in_out, none, bf16, skipped, plain = moved
    assert none is None and bf16 is half and skipped is strided  # not float32 matrices: passed through
    assert emb.data_ptr() % hugepages.HUGE_PAGE == 0 and emb.is_contiguous()
    assert head.data_ptr() == emb.data_ptr() and not head.is_contiguous()  # the tied head: a view of it
    assert in_out.data_ptr() == plain.data_ptr() != out_in.data_ptr() and in_out.t().is_contiguous()
    for got, want in zip(moved, items, strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    small = [torch.ones(3, 3), torch.ones(3, 3).t()]
    assert all(c is t for c, t in zip(huge_page_matrices(small), small, strict=True))


def test_copies_outlive_everything_but_themselves() -> None:
    """The mapping stays alive through the tensors alone."""
    import gc

    copy = huge_page_copies([torch.full((hugepages.MIN_BYTES // 4,), 2.0)])[0]
    gc.collect()
    assert float(copy[-1]) == 2.0


@needs_mapping
def test_zeros_are_allocated_in_place_or_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    from rsmem.hugepages import huge_page_zeros

    shapes = [(4, 1 << 20), (3, 5), (2, 1 << 19)]
    zeros = huge_page_zeros(shapes, torch.float32)
    assert [tuple(z.shape) for z in zeros] == shapes and all(z.dtype == torch.float32 for z in zeros)
    assert all(float(z.abs().sum()) == 0.0 for z in zeros)
    assert zeros[0].data_ptr() % hugepages.HUGE_PAGE == 0  # large: one huge-page mapping
    assert all(z.data_ptr() % hugepages.ALIGN == 0 for z in zeros)
    zeros[1].fill_(1.0)
    assert float(zeros[0].abs().sum()) == 0.0 and float(zeros[2].abs().sum()) == 0.0  # no overlap
    small = huge_page_zeros([(3, 3)], torch.bfloat16)
    assert small[0].dtype == torch.bfloat16 and float(small[0].float().abs().sum()) == 0.0


@needs_mapping
def test_a_large_state_memory_lives_on_one_mapping() -> None:
    from rsmem.memory.recurrent import RecurrentMemory, StateShape

    mem = RecurrentMemory(StateShape(n_layer=4, n_embd_r=3 * 1536, n_embd_s=1536 * 16 * 64), n_seq_max=2)
    rows = [t for t in (*mem.r_l, *mem.s_l) if t is not None]
    base = min(t.data_ptr() for t in rows)
    assert base % hugepages.HUGE_PAGE == 0 and all(float(t.abs().sum()) == 0.0 for t in rows)


@needs_mapping
def test_mamba_holds_its_tied_head_and_matrices_on_one_mapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rsmem import Batch, Context
    from rsmem.models.mamba.mamba1 import MambaConfig
    from rsmem.models.mamba.random_init import random_mamba

    config = MambaConfig(d_model=256, n_layer=2, n_vocab=16400, d_state=8, dt_rank=16)  # 16.8 MB embedding
    model = random_mamba(config, seed=1)
    start = model.embedding.data_ptr()
    assert start % hugepages.HUGE_PAGE == 0 and model.embedding.is_contiguous()
    assert model.lm_head.data_ptr() == start and model.lm_head.t().is_contiguous()  # tied: one copy
    for layer in model.layers:
        for name in model.matrices:
            w = getattr(layer, name)
            assert w.t().is_contiguous() and start < w.data_ptr() < start + (64 << 20)

    monkeypatch.setenv("RSMEM_HUGEPAGES", "0")
    plain = random_mamba(config, seed=1)
    prompt = [5, 17, 250, 3, 99, 1000, 16399]
    got, want = Context(model), Context(plain)
    for ctx in (got, want):
        ctx.decode(Batch(prompt, logits=[True] * len(prompt)))
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
