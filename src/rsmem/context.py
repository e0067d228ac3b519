"""``Context``: a model, its recurrent memory, and the decode flow that ties them (llama.cpp's
``llama_context`` for recurrent models). A hybrid model (one declaring ``kv_layers``) gets a
:class:`~rsmem.memory.hybrid.HybridMemory` (a KV cache beside the recurrent memory; :func:`memory_for`
chooses); ``Context.memory`` is used only through what both offer
(:class:`~rsmem.memory.protocol.SequenceMemory`), and state bytes are the memory's own (``state_write`` /
``state_read``, llama.cpp's layout for each) in :mod:`rsmem.memory.state_io`'s framing.

``decode(batch)``: the allocator validates and fills the batch, the memory plans its micro-batches in a
dry run, then each micro-batch is placed (``apply``) and run through the model; the logits of the
batch's output tokens are kept for ``get_logits``. An invalid batch raises ``InvalidBatchError`` and a
batch the memory cannot place raises ``NoSlotError``; in both cases nothing has changed.

``n_rs_seq = K`` (llama.cpp's context parameter) lets ``memory.seq_rm(s, p0, -1)`` remove up to the last K
positions of a sequence exactly: the Context lends the memory its model to replay the tokens between a
snapshot and ``p0 - 1`` (see :mod:`rsmem.memory.rollback`). 0, the default, keeps none of it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import cast

import torch

from rsmem.batch.allocator import BatchAllocator
from rsmem.batch.batch import Batch, UBatch
from rsmem.errors import InvalidBatchError, NoSlotError
from rsmem.memory import state_io
from rsmem.memory.capture import (
    CaptureKey,
    CaptureRequest,
    UBatchCapture,
    UBatchPlan,
    accepts_capture,
    column_slices,
    plan_ubatch,
    take_at,
)
from rsmem.memory.checkpoint import Checkpoint, check_codec
from rsmem.memory.context import MemoryStatus
from rsmem.memory.hybrid import HybridLayout, HybridMemory
from rsmem.memory.protocol import MemoryBatch, SequenceMemory
from rsmem.memory.recurrent import RecurrentMemory, StateShape
from rsmem.memory.rollback import ScratchState
from rsmem.models.protocol import RecurrentModel
from rsmem.threads import prompt_threads


def memory_for(
    model: RecurrentModel,
    n_seq_max: int,
    *,
    state_dtype: torch.dtype,
    device: torch.device | str,
    n_rs_seq: int,
    n_ctx: int,
    kv_unified: bool,
    kv_dtype: torch.dtype,
) -> SequenceMemory:
    """The memory of ``model``: a :class:`HybridMemory` for a model with attention layers (``kv_layers``),
    else a :class:`RecurrentMemory`; the KV parameters are the hybrid's (see :class:`Context`)."""
    if isinstance(getattr(model, "kv_layers", None), Mapping):
        return HybridMemory.for_model(
            cast(HybridLayout, model),
            n_seq_max,
            n_ctx=n_ctx,
            kv_unified=kv_unified,
            state_dtype=state_dtype,
            kv_dtype=kv_dtype,
            device=device,
            n_rs_seq=n_rs_seq,
        )
    return RecurrentMemory(
        StateShape(model.n_layer, model.n_embd_r, model.n_embd_s),
        n_seq_max,
        dtype=state_dtype,
        device=device,
        layer_filter=model.is_recurrent_layer,
        n_rs_seq=n_rs_seq,
    )


class Context:
    """Runs batches of one model over a recurrent memory of ``n_seq_max`` sequences."""

    def __init__(
        self,
        model: RecurrentModel,
        *,
        n_seq_max: int = 1,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        n_rs_seq: int = 0,
        n_ctx: int = 4096,
        kv_unified: bool = False,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``n_ctx``, ``kv_unified``, ``kv_dtype``: the KV cache of a hybrid model's attention layers
        (``n_ctx`` cells in all: one stream of them shared by every sequence, or ``n_ctx / n_seq_max`` per
        sequence, as llama.cpp's context parameters; K/V in float32, float16 or bfloat16); a model without
        attention layers ignores them."""
        if n_batch < 1 or n_ubatch < 1:
            raise ValueError(f"n_batch and n_ubatch must be positive, got {n_batch} and {n_ubatch}")
        self.model = model
        self.n_batch = n_batch
        self.n_ubatch = min(n_ubatch, n_batch)
        self.memory: SequenceMemory = memory_for(
            model,
            n_seq_max,
            state_dtype=state_dtype,
            device=device,
            n_rs_seq=n_rs_seq,
            n_ctx=n_ctx,
            kv_unified=kv_unified,
            kv_dtype=kv_dtype,
        )
        if self.memory.rollback is not None:
            self.memory.rollback.bind(self._replay, self.n_ubatch)
        self._balloc = BatchAllocator()
        self._logits = torch.empty(0, model.n_vocab)
        self._output_row: dict[int, int] = {}  # batch index -> row of _logits
        self._captured: dict[CaptureKey, Checkpoint] = {}

    @property
    def n_seq_max(self) -> int:
        return self.memory.n_seq_max

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    @property
    def max_seq_tokens(self) -> int | None:
        """The most positions one sequence can hold: a hybrid model's KV cells per sequence (all of them
        when unified, shared with the other sequences); None when nothing bounds it (a recurrent memory)."""
        return self.memory.kv_cells_per_seq

    @property
    def n_rs_seq(self) -> int:
        """How many trailing positions ``memory.seq_rm`` may cut (``llama_n_rs_seq``)."""
        return self.memory.n_rs_seq

    def _replay(self, ubatch: UBatch, states: ScratchState) -> None:
        """Fold a rollback's replay tokens into a scratch state (no logits are kept)."""
        with torch.inference_mode():
            self.model.forward(ubatch, states)

    # ---------------------------------------------------------------- decode

    def decode(
        self, batch: Batch, capture: CaptureRequest | None = None, capture_codec: str = "exact"
    ) -> None:
        """Fold the batch's tokens into their sequences' states and compute the requested logits.

        ``capture`` maps a sequence id to token counts ``n``: keep a checkpoint of the state after that
        sequence's token at position ``n - 1`` wherever it falls in the batch, in ``capture_codec``
        (``"exact"``, ``"bf16"``, ``"int8"``; see :mod:`rsmem.memory.checkpoint`), read by
        :meth:`captured`. Positions the batch does not hold are ignored. Micro-batches are not cut there:
        Mamba and Mamba-2 emit the states from their pass over the whole micro-batch (other models run it
        as slices ending at the positions; see :mod:`rsmem.memory.capture`). Not on a hybrid model's memory
        (its checkpoints carry a KV prefix): ``capture`` raises ValueError there, before anything runs.
        """
        check_codec(capture_codec)
        cells = self.memory.capture_memory() if capture else None
        if capture and cells is None:
            raise ValueError("captures need a recurrent memory (on a hybrid: end the chunk, checkpoint.take)")
        self._captured = {}
        balloc = self._balloc
        balloc.init(batch, n_vocab=self.n_vocab, n_seq_max=self.n_seq_max, memory=self.memory)
        if balloc.n_tokens > self.n_batch:
            raise InvalidBatchError(f"batch has {balloc.n_tokens} tokens, more than n_batch = {self.n_batch}")
        mctx = self.memory.init_batch(balloc, self.n_ubatch)
        if mctx.status is not MemoryStatus.SUCCESS:
            raise NoSlotError(f"no memory slot for a batch of {balloc.n_tokens} tokens")

        output_row = {b: k for k, b in enumerate(i for i, out in enumerate(balloc.outputs) if out)}
        parts: list[tuple[list[int], torch.Tensor]] = []  # (rows of the step's logits, their logits)
        captured: dict[CaptureKey, Checkpoint] = {}
        try:
            with torch.inference_mode():
                while True:
                    mctx.apply()
                    ub = mctx.ubatch
                    plan = plan_ubatch(ub, capture) if capture and cells is not None else None
                    with prompt_threads(ub.n_seq_tokens):  # more threads beside a busy process
                        for sub, ub_logits in self._forward(ub, mctx, cells, plan, capture_codec, captured):
                            rows = [output_row[sub.batch_index[i]] for i in sub.output_rows()]
                            if rows:
                                parts.append((rows, ub_logits))
                    if not mctx.next():
                        break
        except BaseException:
            # Some states may be half-written: drop the batch's sequences rather than keep bad state.
            for seq in {s for ids in balloc.seq_ids for s in ids}:
                self.memory.seq_rm(seq, -1, -1)
            raise
        self._logits = self._gather_logits(parts, len(output_row))
        self._output_row = output_row
        self._captured = captured

    def _gather_logits(self, parts: list[tuple[list[int], torch.Tensor]], n_out: int) -> torch.Tensor:
        """The step's ``[n_out, n_vocab]`` float32 logits from the micro-batches' ``(rows, logits)``: the
        model's own tensor when one micro-batch gave every row in order (a decode step, most prefill
        steps), else a new tensor filled row by row."""
        if len(parts) == 1:
            rows, only = parts[0]
            in_order = only.dtype == torch.float32 and only.shape == (n_out, self.n_vocab)
            if in_order and rows == list(range(n_out)):
                return only
        logits = torch.empty(n_out, self.n_vocab, dtype=torch.float32)
        for rows, ub_logits in parts:
            logits[rows] = ub_logits
        return logits

    def _forward(
        self,
        ub: UBatch,
        states: MemoryBatch,
        cells: RecurrentMemory | None,
        plan: UBatchPlan | None,
        codec: str,
        captured: dict[CaptureKey, Checkpoint],
    ) -> Iterator[tuple[UBatch, torch.Tensor]]:
        """Run one placed micro-batch (as slices for a model that cannot capture ``plan``'s inner points),
        yielding each part and its logits; adds the checkpoints of ``plan``, read from ``cells``, to
        ``captured``."""
        if plan is None or cells is None:
            yield ub, self.model.forward(ub, states)
            return
        inner = plan.inner()
        if inner and accepts_capture(self.model):
            sink = UBatchCapture(cells, [plan.points[i] for i in inner], codec)
            yield ub, self.model.forward(ub, states, capture=sink)  # type: ignore[call-arg]
            for i, ckpt in zip(inner, sink.checkpoints([plan.pos[i] for i in inner]), strict=True):
                captured.update(dict.fromkeys(plan.keys[i], ckpt))
            _take_ending(cells, ub, plan, ub.n_seq_tokens - 1, codec, captured)
            return
        end = 0
        for part in column_slices(ub, [plan.points[i][1] for i in inner]):
            yield part, self.model.forward(part, states)
            end += part.n_seq_tokens
            _take_ending(cells, ub, plan, end - 1, codec, captured)

    def captured(self) -> dict[CaptureKey, Checkpoint]:
        """The checkpoints the last :meth:`decode` captured, by ``(seq_id, n)`` as requested (only those
        whose position was in the batch); empty after a decode that raised. Each has the ``pos`` and rows
        ``checkpoint.take`` would have recorded had the batch ended after position ``n - 1``."""
        return dict(self._captured)

    # ---------------------------------------------------------------- logits

    @property
    def logits(self) -> torch.Tensor:
        """Logits of the last decode's output tokens, in batch order: ``[n_outputs, n_vocab]``. Often the
        model's own output tensor (no copy), made under ``torch.inference_mode``: read it, or clone it to
        change it in place."""
        return self._logits

    def get_logits(self, i: int) -> torch.Tensor:
        """Logits of batch token ``i`` (``llama_get_logits_ith``); negative ``i`` counts back over outputs."""
        n_out = self._logits.shape[0]
        if i < 0:
            if -i > n_out:
                raise IndexError(f"output {i} does not exist: the last decode produced {n_out} outputs")
            return self._logits[n_out + i]
        row = self._output_row.get(i)
        if row is None:
            raise IndexError(f"token {i} of the last batch was not marked for output")
        return self._logits[row]

    # --------------------------------------------------------- state saving
    # The memory writes and reads its own state bytes (state_write / state_read: a hybrid's KV part, then the
    # recurrent payload); rsmem.memory.state_io frames them as llama.cpp's blobs and files.

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """One sequence's state as bytes (``llama_state_seq_get_data``)."""
        return state_io.seq_blob(self.memory, seq_id)

    def state_seq_get_size(self, seq_id: int) -> int:
        return len(self.state_seq_get_data(seq_id))

    def state_seq_set_data(self, data: bytes, dest_seq_id: int) -> int:
        """Restore a sequence blob into ``dest_seq_id``; returns bytes read. Raises StateFormatError."""
        return state_io.load_seq_blob(self.memory, data, dest_seq_id)

    def state_seq_file_bytes(self, seq_id: int, tokens: list[int]) -> bytes:
        """The bytes of a 'ggsq' sequence file of ``seq_id`` with ``tokens``."""
        return state_io.seq_file_bytes(self.memory, seq_id, list(tokens))

    def state_seq_save_file(self, path: str | os.PathLike[str], seq_id: int, tokens: list[int]) -> int:
        """Write a 'ggsq' sequence file (atomically); returns the bytes written."""
        return state_io.atomic_write(path, self.state_seq_file_bytes(seq_id, tokens))

    def state_seq_load_file(self, path: str | os.PathLike[str], dest_seq_id: int) -> list[int]:
        """Restore a 'ggsq' sequence file into ``dest_seq_id``; returns the tokens saved with it."""
        with open(path, "rb") as f:
            data = f.read()
        return state_io.load_seq_file_bytes(self.memory, data, dest_seq_id, self.n_vocab)

    def state_get_data(self) -> bytes:
        """The whole context's state (every sequence) as bytes."""
        return state_io.context_state_bytes(self.memory, self.model.arch)

    def state_set_data(self, data: bytes) -> int:
        reader = state_io.Reader(data)
        state_io.load_context_state(self.memory, reader, self.model.arch)
        return reader.offset

    def state_save_file(self, path: str | os.PathLike[str], tokens: list[int]) -> int:
        """Write a 'ggsn' session file with every sequence's state (atomically)."""
        data = state_io.session_file_bytes(self.memory, self.model.arch, list(tokens))
        return state_io.atomic_write(path, data)

    def state_load_file(self, path: str | os.PathLike[str]) -> list[int]:
        with open(path, "rb") as f:
            data = f.read()
        return state_io.load_session_file_bytes(self.memory, data, self.model.arch, self.n_vocab)


def _take_ending(
    cells: RecurrentMemory,
    ub: UBatch,
    plan: UBatchPlan,
    t: int,
    codec: str,
    captured: dict[CaptureKey, Checkpoint],
) -> None:
    """Add the checkpoints of ``plan``'s points after token ``t``, which ``cells`` hold now."""
    for i in plan.ending_at(t):
        ckpt = take_at(cells, ub, plan.points[i][0], plan.pos[i], codec)
        captured.update(dict.fromkeys(plan.keys[i], ckpt))
