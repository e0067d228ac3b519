"""Fault injection: a model wrapper that fails on chosen micro-batches, for tests and load benchmarks.

``FaultyModel(model)`` behaves exactly like ``model`` until told otherwise:

- ``raise_when(pred)``: ``forward`` raises :class:`InjectedFault` for every micro-batch whose sequence
  ids ``pred`` accepts (before it touches any state, or after writing some layers when
  ``after_layers`` is set, to leave half-written states as a real crash would);
- ``poison(seq)``: the next micro-batch holding ``seq`` writes NaN into that sequence's states, as a
  numerical blow-up inside the model would.

It satisfies the :class:`~rsmem.models.protocol.RecurrentModel` protocol, so a ``Context``, an
``Engine`` and the server run on it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rsmem.batch.batch import UBatch
from rsmem.models.protocol import RecurrentModel, StateAccess

SeqPredicate = Callable[[frozenset[int]], bool]


class InjectedFault(RuntimeError):
    """Raised by :class:`FaultyModel` where a fault was asked for."""


class FaultyModel:
    def __init__(self, model: RecurrentModel) -> None:
        self.inner = model
        self.n_vocab = model.n_vocab
        self.n_layer = model.n_layer
        self.n_embd_r = model.n_embd_r
        self.n_embd_s = model.n_embd_s
        self.arch = model.arch
        self.tokenizer = getattr(model, "tokenizer", None)
        self._raise_when: SeqPredicate | None = None
        self._after_layers = 0
        self._poisoned: set[int] = set()
        self.faults_raised = 0

    def raise_when(self, pred: SeqPredicate | None, *, after_layers: int = 0) -> None:
        """Fail every micro-batch whose set of sequence ids satisfies ``pred`` (None: never)."""
        self._raise_when = pred
        self._after_layers = after_layers

    def poison(self, seq: int) -> None:
        """Write NaN into ``seq``'s states at the next micro-batch that holds it."""
        self._poisoned.add(seq)

    def is_recurrent_layer(self, il: int) -> bool:
        return self.inner.is_recurrent_layer(il)

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        seqs = frozenset(s for ids in ubatch.seq_ids for s in ids)
        failing = self._raise_when is not None and self._raise_when(seqs)
        poisoned = [k for k, s in enumerate(ubatch.primary_seq_ids) if s in self._poisoned]
        if failing and self._after_layers == 0:
            self.faults_raised += 1
            raise InjectedFault(f"injected fault in a micro-batch of sequences {sorted(seqs)}")
        access = _Tap(states, self, failing, poisoned)
        logits = self.inner.forward(ubatch, access)
        if failing:  # fewer recurrent layers than after_layers: fail at the end
            self.faults_raised += 1
            raise InjectedFault(f"injected fault after the layers of sequences {sorted(seqs)}")
        self._poisoned.difference_update(ubatch.primary_seq_ids)
        return logits


class _Tap:
    """Passes state reads and writes through, raising or poisoning where the fault asks."""

    def __init__(self, states: StateAccess, owner: FaultyModel, failing: bool, poisoned: list[int]) -> None:
        self.states, self.owner, self.failing, self.poisoned = states, owner, failing, poisoned
        self.written = 0

    def read_states(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states.read_states(il)

    def write_states(self, il: int, r_out: torch.Tensor, s_out: torch.Tensor) -> None:
        if self.poisoned:
            r_out, s_out = r_out.clone(), s_out.clone()
            r_out[self.poisoned] = float("nan")
            s_out[self.poisoned] = float("nan")
        self.states.write_states(il, r_out, s_out)
        self.written += 1
        if self.failing and self.written >= self.owner._after_layers:
            self.owner.faults_raised += 1
            raise InjectedFault(f"injected fault after {self.written} layers")
