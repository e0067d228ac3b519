"""What a model must offer to run on a :class:`~rsmem.context.Context`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from rsmem.batch.batch import UBatch


@runtime_checkable
class StateAccess(Protocol):
    """The memory context as a model forward sees it (see ``RecurrentMemoryContext``)."""

    def read_states(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``il``'s input ``(r, s)`` rows for the micro-batch's sequences, ``[n_seqs, n_embd_*]``."""
        ...

    def write_states(self, il: int, r_out: torch.Tensor, s_out: torch.Tensor) -> None:
        """Store layer ``il``'s output rows for the micro-batch's sequences."""
        ...


@runtime_checkable
class RecurrentModel(Protocol):
    """A recurrent language model whose per-sequence state lives in a ``RecurrentMemory``.

    ``forward`` processes one micro-batch: ``ubatch.token_tensor()`` is ``[n_seqs, n_seq_tokens]``; for
    each recurrent layer it reads input states with ``states.read_states(il)`` and writes the states
    after the last token with ``states.write_states(il, r, s)``. It returns float32 logits for the
    micro-batch's output tokens only, ``[ubatch.n_outputs, n_vocab]``, in micro-batch order.

    The sizes are read-only here (properties): a model may hold them as instance attributes, class
    attributes (``arch``) or properties.
    """

    @property
    def n_vocab(self) -> int:
        """Rows of the LM head: the logits' width."""
        ...

    @property
    def n_layer(self) -> int:
        """Layers, recurrent or not; the memory keeps rows for those :meth:`is_recurrent_layer` names."""
        ...

    @property
    def n_embd_r(self) -> int:
        """Values in one sequence's ``r`` row (conv window / token shift) of one layer."""
        ...

    @property
    def n_embd_s(self) -> int:
        """Values in one sequence's ``s`` row (SSM state) of one layer."""
        ...

    @property
    def arch(self) -> str:
        """The architecture's name, as GGUF's ``general.architecture`` (written into session files)."""
        ...

    def is_recurrent_layer(self, il: int) -> bool:
        """Whether layer ``il`` has a recurrent state (rows in the memory)."""
        ...

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; reads and writes the states through ``states``."""
        ...
