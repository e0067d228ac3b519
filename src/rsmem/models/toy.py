"""A tiny recurrent model whose outputs can be checked exactly with plain Python state.

Each layer keeps a decayed running sum ``s = decay * s + x`` (the ``s`` state) and the previous input
``x`` (the ``r`` state, a one-step token shift), and outputs ``x + s + 0.5 * r``. It exercises every
path of the memory (zero rows, copies, reordering, state files) without the numerics of a real model.
"""

from __future__ import annotations

import torch

from rsmem.batch.batch import UBatch
from rsmem.models.protocol import StateAccess


class DecayedSumModel:
    """``n_layer`` layers of decayed sums over token embeddings, then a linear LM head."""

    arch = "rsmem-toy"

    def __init__(self, n_vocab: int = 32, n_embd: int = 4, n_layer: int = 2, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n_vocab, self.n_embd, self.n_layer = n_vocab, n_embd, n_layer
        self.n_embd_r = n_embd
        self.n_embd_s = n_embd
        self.embedding = torch.randn(n_vocab, n_embd, generator=g, dtype=torch.float64)
        self.decay = torch.linspace(0.5, 0.9, n_layer, dtype=torch.float64)
        self.head = torch.randn(n_embd, n_vocab, generator=g, dtype=torch.float64)

    def is_recurrent_layer(self, il: int) -> bool:
        return True

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        x = self.embedding[ubatch.token_tensor()]  # [n_seqs, n_seq_tokens, n_embd]
        for il in range(self.n_layer):
            r, s = states.read_states(il)
            r, s = r.to(torch.float64), s.to(torch.float64)
            outs = []
            for t in range(x.shape[1]):  # a test model: clarity over speed
                xt = x[:, t]
                s = self.decay[il] * s + xt
                outs.append(xt + s + 0.5 * r)
                r = xt
            states.write_states(il, r, s)
            x = torch.stack(outs, dim=1)
        flat = x.reshape(-1, self.n_embd)[ubatch.output_rows()]
        return (flat @ self.head).to(torch.float32)

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every token of one sequence decoded from an empty state, in plain Python order."""
        n = self.n_embd
        r = [torch.zeros(n, dtype=torch.float64) for _ in range(self.n_layer)]
        s = [torch.zeros(n, dtype=torch.float64) for _ in range(self.n_layer)]
        out = []
        for tok in tokens:
            x = self.embedding[tok]
            for il in range(self.n_layer):
                s[il] = self.decay[il] * s[il] + x
                y = x + s[il] + 0.5 * r[il]
                r[il] = x
                x = y
            out.append((x @ self.head).to(torch.float32))
        return torch.stack(out)
