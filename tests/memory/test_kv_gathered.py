"""Attention over each token's gathered cells (memory/kv_attention.py ``gathered_cells``: a decode step of
several sequences in one unified stream) gives the logits of attention over the whole stream, and the
causal masks are right for sequence ids past 63 (two 64-bit words of cell bits)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem.memory import kv_attention
from rsmem.memory.kv_cells import KVCells, visible

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
GATHERED_CELLS = kv_attention.gathered_cells


@pytest.mark.parametrize("n_seqs", [10, 63, 64, 65, 130])
def test_visible_for_any_sequence_ids(n_seqs: int) -> None:
    rng = random.Random(n_seqs)
    cells = KVCells(200)
    for i in range(150):
        cells.occupy(i, rng.randint(0, 50), set(rng.sample(range(n_seqs), rng.randint(1, 3))))
    cells.rm(7)
    seqs = [rng.randrange(n_seqs) for _ in range(40)] + [n_seqs - 1]
    pos = [rng.randint(0, 60) for _ in seqs]
    got = visible(cells, 160, seqs, pos, torch.device("cpu"))
    want = torch.tensor(
        [
            [cells.pos[j] >= 0 and s in cells.seqs[j] and cells.pos[j] <= p for j in range(160)]
            for s, p in zip(seqs, pos)
        ]
    )
    assert torch.equal(got, want)
    assert want.any()


def test_gathered_cells_lists_each_tokens_cells() -> None:
    mask = torch.zeros(1, 3, 10, dtype=torch.bool)
    mask[0, 0, [0, 3]] = True
    mask[0, 1, [1]] = True
    mask[0, 2, [2, 4, 9]] = True
    found = kv_attention.gathered_cells(mask, torch.tensor([20]))
    assert found is not None
    index, valid = found
    assert valid.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert index[valid].tolist() == [20, 23, 21, 22, 24, 29]
    assert kv_attention.gathered_cells(mask[:, :1], torch.tensor([0])) is None  # one token a group
    assert kv_attention.gathered_cells(torch.ones(1, 3, 10, dtype=torch.bool), torch.tensor([0])) is None


def _decode_all(model, monkeypatch: pytest.MonkeyPatch, gather: bool) -> tuple[list[torch.Tensor], int]:
    """Prompts of different lengths for 66 sequences in one unified stream (one forked), then decode steps
    of all of them together; the logits and how often the gathered path ran."""
    used = [0]

    def counted(mask: torch.Tensor, rows: torch.Tensor):
        found = GATHERED_CELLS(mask, rows) if gather else None
        used[0] += found is not None
        return found

    monkeypatch.setattr(kv_attention, "gathered_cells", counted)
    n = 66
    ctx = rsmem.Context(model, n_seq_max=n, n_ctx=4096, kv_unified=True)
    for s in range(n - 1):
        ctx.decode(rsmem.Batch([(3 * s + i) % 50 + 1 for i in range(1 + s % 5)], seq_ids=[[s]] * (1 + s % 5)))
    ctx.memory.seq_cp(2, n - 1, -1, -1)  # shares seq 2's cells
    out = []
    for k in range(3):
        ctx.decode(
            rsmem.Batch(
                [(s + k) % 40 + 1 for s in range(n)], seq_ids=[[s] for s in range(n)], logits=[True] * n
            )
        )
        out.append(ctx.logits.clone())
    return out, used[0]


@pytest.mark.parametrize("arch", ["lfm2", "nemotron_h"])
def test_gathered_attention_matches_the_whole_stream(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    want, none = _decode_all(model, monkeypatch, gather=False)
    got, used = _decode_all(model, monkeypatch, gather=True)
    assert none == 0 and used >= 3  # the decode steps took the gathered path
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sdpa_row_keys", [0, kv_attention.SDPA_ROW_KEYS])
@pytest.mark.parametrize(("n", "n_head_kv"), [(1, 4), (3, 4), (16, 12), (5, 1), (17, 4)])
def test_grouped_attention_equals_sdpa(
    n: int, n_head_kv: int, sdpa_row_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct products for a few queries a row (``SDPA_ROW_KEYS`` 0: every row takes them) give SDPA's
    result (grouped query heads included), as does the path for few keys a row."""
    monkeypatch.setattr(kv_attention, "SDPA_ROW_KEYS", sdpa_row_keys)
    gen = torch.Generator().manual_seed(n)
    b, m, n_head, d = 3, 40, 12, 16
    q = torch.randn(b, n, n_head, d, generator=gen)
    keys, values = (
        torch.randn(b, m, n_head_kv, d, generator=gen),
        torch.randn(b, m, n_head_kv, d, generator=gen),
    )
    mask = torch.rand(b, n, m, generator=gen) < 0.6
    mask[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None], scale=0.3,
        enable_gqa=True,
    ).transpose(1, 2)  # fmt: skip
    got = kv_attention.grouped_attention(q, keys, values, kv_attention.additive(mask), 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_small_attention_runs_on_one_thread_and_restores_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode attention over few keys takes SDPA's one op on one thread; over many keys a row the grouped
    products, on every thread."""
    seen: list[tuple[str, int]] = []
    real_matmul, real_sdpa = torch.matmul, torch.nn.functional.scaled_dot_product_attention

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(("matmul", torch.get_num_threads()))
        return real_matmul(a, b)

    def sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(("sdpa", torch.get_num_threads()))
        return real_sdpa(*args, **kwargs)  # type: ignore[arg-type]

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(torch, "matmul", matmul)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        q, kv = torch.randn(2, 1, 12, 16), torch.randn(2, 10, 4, 16)
        kv_attention.grouped_attention(q, kv, kv, torch.zeros(2, 1, 10), 0.25)
        assert seen == [("sdpa", 1)] and torch.get_num_threads() == 2
        mid = torch.randn(2, kv_attention.ONE_THREAD_KV // 64, 4, 16)  # few keys a row, much work: 2 threads
        kv_attention.grouped_attention(q, mid, mid, torch.zeros(2, 1, mid.shape[1]), 0.25)
        assert seen[1:] == [("sdpa", 2)]
        big = torch.randn(1, kv_attention.SDPA_ROW_KEYS // 64 + 1, 4, 16)
        kv_attention.grouped_attention(q[:1], big, big, torch.zeros(1, 1, big.shape[1]), 0.25)
        assert seen[2:] == [("matmul", 2), ("matmul", 2)]
    finally:
        torch.set_num_threads(before)
