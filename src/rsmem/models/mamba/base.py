"""What Mamba and Mamba-2 share: weight preparation and the per-layer forward skeleton.

Each architecture keeps its mixer (and how its state rows are viewed) in its own module; this one holds
the residual stream around it: embedding, per layer ``read_states`` -> ``rms_norm`` -> mixer ->
``write_states`` -> residual, then the output rows, the final norm and the LM head.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from rsmem.batch.batch import Batch, UBatch
from rsmem.hugepages import huge_page_matrices
from rsmem.models.ops.common import CapturePoints, output_rows
from rsmem.models.ops.norm import rms_norm
from rsmem.models.ops.quantized import Matrix, QuantMatrix, as_float32, embed
from rsmem.models.protocol import StateAccess
from rsmem.models.step.compiled import ONE_THREAD_GLUE, CompiledStep, CompileSetting, resolve_compile
from rsmem.models.step.fused import RowsOperand, SmallRows, token_step, token_step_many
from rsmem.models.step.memo import StepMemo
from rsmem.models.step.native import NativeStep
from rsmem.models.step.packed import PackedMatrices, held_matrix, packing_enabled
from rsmem.models.step.path import DecodePath, decode_path
from rsmem.models.step.small_rows import many_operand, one_operand

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from rsmem.memory.capture import StateCapture


def prepare_layer(layer: Any, matrices: tuple[str, ...], dtype: torch.dtype, packing: bool = False) -> Any:
    """A copy of a slotted layer record: ``matrices`` as ``[in, out]`` tensors in ``dtype`` (see
    :func:`~rsmem.models.step.packed.held_matrix`), every other tensor float32 and contiguous."""
    return type(layer)(
        **{
            name: held_matrix(getattr(layer, name), dtype, packing)
            if name in matrices
            else getattr(layer, name).to(torch.float32).contiguous()
            for name in layer.__slots__
        }
    )


class MambaFamilyModel:
    """The model around a Mamba-style mixer; implements :class:`~rsmem.models.protocol.RecurrentModel`.

    Matrices are kept in ``dtype`` (float32 or bfloat16); norms, conv, ``A``, ``D`` and the scans stay
    float32, as do the residual stream and the states. Subclasses set ``arch`` and ``matrices``, pass the
    shapes of their states, and define :meth:`mixer`.
    """

    arch: ClassVar[str]
    matrices: ClassVar[tuple[str, ...]]  # layer fields held transposed, [in, out], in the compute dtype
    # inductor's cpp.min_chunk_size for the compiled steps (None: its default; see GLUE_MIN_CHUNK)
    glue_min_chunk: ClassVar[int | None] = None

    def __init__(
        self,
        config: Any,
        weights: Any,
        *,
        dtype: torch.dtype,
        conv_channels: int,
        state_shape: tuple[int, ...],
        compile: CompileSetting = None,
    ):
        """``conv_channels``: channels of the conv window (``r`` is ``[conv_channels, d_conv-1]`` per
        sequence); ``state_shape``: one sequence's SSM state ``s``; ``compile``: see :meth:`set_compile`."""
        self.config = config
        self.dtype = dtype
        self.n_vocab = config.n_vocab
        self.n_layer = config.n_layer
        self.n_embd_r = (config.d_conv - 1) * conv_channels
        self.n_embd_s = math.prod(state_shape)
        self._window_shape = (conv_channels, config.d_conv - 1)
        self._state_shape = state_shape
        self.tokenizer: Tokenizer | None = None  # set by the loaders when the file carries one
        self.embedding = as_float32(weights.embedding)
        self.norm_f = weights.norm_f.to(torch.float32)
        tied = weights.lm_head is weights.embedding
        packing = packing_enabled()
        # [in, out] (see ops.packed.held_matrix): with packing, a view of the [out, in] matrix, so a tied
        # float32 head shares the embedding; without, a transposed copy
        self.lm_head = held_matrix(self.embedding if tied else weights.lm_head, dtype, packing)
        self.layers = [prepare_layer(layer, self.matrices, dtype, packing) for layer in weights.layers]
        self._to_huge_pages()
        self.packed = PackedMatrices()  # faster twins (see ops.packed)
        matrices = [self.lm_head, *(getattr(ly, name) for ly in self.layers for name in self.matrices)]
        if packing:
            for matrix in matrices:
                self.packed.add(matrix)
        self._n_matrix_weights = sum(m.numel() for m in matrices)
        # The one-sequence compiled step streams [out, in] rows: only worth it when the matrices are held
        # that way (float32 with packing); bf16 [in, out] copies decode one sequence faster eagerly.
        self._rows_contiguous = all(isinstance(m, QuantMatrix) or m.t().is_contiguous() for m in matrices)
        self.compile_decode = False
        self._one_args: tuple[Any, list[tuple[Any, ...]]] | None = None
        self._many_args: tuple[Any, list[tuple[Any, ...]]] | None = None
        self._native = self.native_step()
        self._flat_memo: StepMemo[list[Any]] = StepMemo()  # the steps' flat operands (steady decode)
        self.set_compile(compile)

    def _to_huge_pages(self) -> None:
        """Move the embedding, the head and every float32 matrix onto huge pages
        (:func:`~rsmem.hugepages.huge_page_matrices`: a one-sequence decode step reads them all from
        memory). A tied head stays a view of the embedding; quantized matrices stay where the loader put
        them (their blocks are a fraction of the bytes)."""
        slots = [(self, "embedding"), (self, "lm_head")]
        slots += [(layer, name) for layer in self.layers for name in self.matrices]
        moved = huge_page_matrices([getattr(owner, name) for owner, name in slots])
        for (owner, name), tensor in zip(slots, moved, strict=True):
            setattr(owner, name, tensor)

    def set_compile(self, setting: CompileSetting) -> bool:
        """Whether one-token steps run through ``torch.compile`` (see :mod:`rsmem.models.step.compiled`):
        ``"auto"``, True/False or ``"1"``/``"0"``; None reads ``RSMEM_COMPILE``. Returns the decision."""
        self.compile_decode = resolve_compile(setting, self._n_matrix_weights, self.norm_f.device)
        if self.compile_decode and not hasattr(self, "_token_step_one"):
            layer_fn, n_fields, consts = self.layer_one()

            def mutated(i: int) -> bool:  # args: x, norm_f, lm_head, eps, then per layer n_fields tensors
                return i >= 4 and (i - 4) % n_fields >= n_fields - 2  # ending with window and h

            glue = {"cpp.min_chunk_size": self.glue_min_chunk} if self.glue_min_chunk else None
            # one sequence: the few-row kernel's products where the kernels are loaded, and then every
            # inductor kernel on the calling thread (ONE_THREAD_GLUE)
            kernel_products = isinstance(self.one_operand(self.lm_head), SmallRows)
            self._token_step_one = CompiledStep(
                token_step(layer_fn, n_fields, consts),
                mutated=mutated,
                options=dict(ONE_THREAD_GLUE) if kernel_products else glue,
            )
            states = [
                4 + il * n_fields + k for il in range(self.n_layer) for k in (n_fields - 2, n_fields - 1)
            ]
            self._token_step_many = CompiledStep(
                token_step_many(self.layer_many(), n_fields, consts),
                batch_args=(0, *states),
                mutated=mutated,
                options=glue,
            )
            self.make_compiled_steps()
            # what the steps take besides x and the states: (step, head, each layer's weights), for one
            # sequence (as one_operand gives them) and for several (as rows_operand gives them)
            self._step_args = [
                (self._token_step_one, *self.one_sequence_args()),
                (self._token_step_many, *self.many_sequence_args()),
            ]
        return self.compile_decode

    def warm_up(self) -> float:
        """Compile every step variant now, on a scratch memory (nothing else is touched), so that a
        server's first requests do not wait for it; returns the seconds it took (0 when not compiling).

        Covers a one-sequence and a two-sequence prefill and decode: the batched variants have a dynamic
        batch size, so every later width reuses them. Where the C++ step takes those decodes (up to
        ``MAX_ROWS`` sequences), the batched step, which takes wider ones, runs once on scratch states."""
        if not self.compile_decode:
            return 0.0
        from rsmem.context import Context  # imported here: rsmem.context imports the models package

        started = time.perf_counter()
        ctx = Context(self, n_seq_max=2)
        ctx.decode(Batch([1] * 20, seq_ids=[[0]] * 20))
        ctx.decode(Batch([1] * 6, seq_ids=[[0]] * 3 + [[1]] * 3))
        ctx.decode(Batch([1], seq_ids=[[0]]))
        ctx.decode(Batch([1, 1], seq_ids=[[0], [1]], logits=[True, True]))
        if self._native is not None and self._native.usable(2):
            self._warm_batched_step()
        return time.perf_counter() - started

    @torch.inference_mode()  # as Context.decode runs it: dynamo's guards include the grad mode
    def _warm_batched_step(self) -> None:
        """One call of the compiled batched step on scratch states of two sequences. They are made as the
        memory's are, outside inference mode: dynamo guards on a tensor's dispatch keys, and inference
        tensors as states made the first step of more than ``MAX_ROWS`` sequences compile it again."""
        step, head, weights = self._step_args[True]
        with torch.inference_mode(False):
            scratch = [
                self.state_views(torch.zeros(2, self.n_embd_r), torch.zeros(2, self.n_embd_s), 2)
                for _ in weights
            ]
        flat = [t for w, v in zip(weights, scratch, strict=True) for t in (*w, *v)]
        step(
            embed(self.embedding, torch.ones(2, dtype=torch.long)), self.norm_f, head, self.config.eps, *flat
        )

    def native_step(self) -> NativeStep | None:
        """The architecture's decode step in C++ (Mamba, Mamba-2), else None."""
        return None

    def one_sequence_args(self) -> tuple[Any, list[tuple[Any, ...]]]:
        """The head and each layer's weights as the one-sequence steps take them (:meth:`one_operand`)."""
        if self._one_args is None:
            self._one_args = (
                self.one_operand(self.lm_head),
                [self.layer_args(ly, self.one_operand) for ly in self.layers],
            )
        return self._one_args

    def many_sequence_args(self) -> tuple[Any, list[tuple[Any, ...]]]:
        """The head and each layer's weights as the steps of several sequences take them
        (:meth:`rows_operand`)."""
        if self._many_args is None:
            self._many_args = (
                self.rows_operand(self.lm_head),
                [self.layer_args(ly, self.rows_operand) for ly in self.layers],
            )
        return self._many_args

    def make_compiled_steps(self) -> None:
        """Create the architecture's :class:`~rsmem.models.step.compiled.CompiledStep` objects besides the
        whole
        decode steps (Mamba: its prefill scan blocks)."""

    def layer_one(self) -> tuple[Callable[..., torch.Tensor], int, tuple[float | int, ...]]:
        """The architecture's one-sequence block of :mod:`~rsmem.models.step.fused`, the number of tensors
        :meth:`layer_args` and the two states give it, and the constants that follow them."""
        raise NotImplementedError

    def layer_many(self) -> Callable[..., torch.Tensor]:
        """The block of :meth:`layer_one` for one token of each of several sequences (same arguments)."""
        raise NotImplementedError

    def layer_args(self, layer: Any, operand: Callable[[Matrix], Any]) -> tuple[Any, ...]:
        """One layer's tensors for the blocks of :meth:`layer_one` and :meth:`layer_many`, but for the
        ``window`` and ``h`` that end them (the states they update), each matrix as ``operand`` gives it."""
        raise NotImplementedError

    def rows_operand(self, weight_t: Matrix) -> RowsOperand:
        """A matrix ``[in, out]`` of this model as several sequences' step takes it
        (:func:`~rsmem.models.step.small_rows.many_operand`)."""
        return many_operand(weight_t, self.packed.twin(weight_t))

    def one_operand(self, weight_t: Matrix) -> Matrix | SmallRows:
        """A matrix ``[in, out]`` of this model as the one-sequence step takes it
        (:func:`~rsmem.models.step.small_rows.one_operand`)."""
        return one_operand(weight_t, self.packed.twin(weight_t))

    def is_recurrent_layer(self, il: int) -> bool:
        return True

    def forward(
        self, ubatch: UBatch, states: StateAccess, capture: StateCapture | None = None
    ) -> torch.Tensor:
        """The protocol's forward; with ``capture``, also hands ``capture.keep`` each layer's states after
        the points ``capture.points`` (``(s, t)``: sequence set ``s`` after its token ``t``), from the same
        pass: projections, conv and scan run over the whole micro-batch (see :meth:`mixer`)."""
        eps = self.config.eps
        tokens = ubatch.token_tensor()  # [Bs, L]
        n_seqs, n_tokens = tokens.shape
        at = capture.points if capture is not None else ()
        if n_tokens == 1 and not at and self.decode_path(n_seqs) != "layers":
            return self.decode_forward(tokens[:, 0], ubatch, states)
        x = embed(self.embedding, tokens)  # [Bs, L, d_model], a fresh tensor: the residual adds in place
        for il, layer in enumerate(self.layers):
            r, s = states.read_states(il)
            window, h = self.state_views(r, s, n_seqs)
            out, kept = self.mixer(layer, rms_norm(x, layer.norm, eps), window, h, at)
            states.write_states(il, window, h)  # no copy when they are the memory's rows
            if capture is not None and kept is not None:
                capture.keep(il, kept[0].reshape(len(at), -1), kept[1].reshape(len(at), -1))
            x += out
        return self.head(x, ubatch)

    def decode_forward(self, tokens: torch.Tensor, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """:meth:`forward` for one token a sequence (``tokens`` ``[Bs]``): through the C++ step where it runs
        for this many sequences (:meth:`native_step`), else through the compiled steps."""
        eps = self.config.eps
        x = embed(self.embedding, tokens)  # [Bs, d_model]
        n_seqs = x.shape[0]
        rows = [states.read_states(il) for il in range(self.n_layer)]
        native, logits = self._native, None
        if native is not None and self.decode_path(n_seqs) == "native":
            head, weights = self.one_sequence_args()
            flat = self.step_flat(weights, rows)
            if native.accepts(head, flat) and native.check(x, self.norm_f, head, eps, flat):
                logits = native.run(x, self.norm_f, head, eps, flat)
        if logits is None:  # no C++ step, its check failed, or an operand it does not take
            step, head, weights = self._step_for(n_seqs)
            flat = self.step_flat(weights, rows)
            logits = step(x, self.norm_f, head, eps, *flat)
        per_layer = len(flat) // self.n_layer
        for il in range(self.n_layer):
            states.write_states(il, flat[(il + 1) * per_layer - 2], flat[(il + 1) * per_layer - 1])
        wanted = ubatch.output_rows()
        if len(wanted) == n_seqs:
            return logits
        return logits.index_select(0, torch.tensor(wanted, dtype=torch.long, device=logits.device))

    def decode_path(self, n_seqs: int) -> DecodePath:
        """:func:`~rsmem.models.step.native.decode_path` of this model: its C++ step runs with or without
        compiling."""
        return decode_path(
            self._native,
            n_seqs,
            compiled=self.compile_decode,
            rows_contiguous=self._rows_contiguous,
            native_without_compile=True,
        )

    def step_flat(
        self, weights: list[tuple[Any, ...]], rows: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[Any]:
        """Each layer's ``weights`` then its ``(window, h)`` (:meth:`state_views` of its state ``rows``), as
        one list; kept while the rows are the same float32 views (:class:`StepMemo`; other rows' float32
        copies are made afresh, from what the memory holds)."""
        n_seqs = rows[0][0].shape[0]

        def build() -> list[Any]:
            views = [self.state_views(r, s, n_seqs) for r, s in rows]
            return [t for w, v in zip(weights, views, strict=True) for t in (*w, *v)]

        if any(r.dtype != torch.float32 or s.dtype != torch.float32 for r, s in rows):
            return build()
        return self._flat_memo.get((weights, *rows), build)

    def _step_for(self, n_seqs: int) -> tuple[Callable[..., torch.Tensor], Any, list[tuple[Any, ...]]]:
        """``(step, head, each layer's weights)`` of the compiled step for ``n_seqs`` sequences; when not
        compiling, the same functions run eagerly."""
        if self.compile_decode:
            return self._step_args[n_seqs > 1]
        layer_fn, n_fields, consts = self.layer_one()
        if n_seqs == 1:
            step = self._native.twin if self._native is not None else token_step(layer_fn, n_fields, consts)
            return (step, *self.one_sequence_args())
        return (token_step_many(self.layer_many(), n_fields, consts), *self.many_sequence_args())

    def head(self, x: torch.Tensor, ubatch: UBatch) -> torch.Tensor:
        """Logits of the micro-batch's output rows of the residual stream ``x``: final norm, LM head."""
        x = output_rows(x, ubatch.output_rows())
        return self.linear(rms_norm(x, self.norm_f, self.config.eps), self.lm_head).float()

    def linear(self, x: torch.Tensor, weight_t: Matrix) -> torch.Tensor:
        """``x @ weight_t`` for a matrix ``[in, out]`` of this model, as float32 (ops.common, ops.packed)."""
        return self.packed.linear(x, weight_t)

    def state_views(self, r: torch.Tensor, s: torch.Tensor, n_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[n_seqs, n_embd_*]`` state rows as the mixer's float32 ``(window, h)`` tensors.

        Float32 rows are viewed, not copied, so a mixer that updates them in place writes the memory.
        """
        return r.view(n_seqs, *self._window_shape).float(), s.view(n_seqs, *self._state_shape).float()

    def mixer(
        self, layer: Any, u: torch.Tensor, window: torch.Tensor, h: torch.Tensor, at: CapturePoints = ()
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The mixer over ``u`` ``[Bs, L, d_model]``: returns its output and updates the conv ``window`` and
        the SSM state ``h`` in place to their values after the last token. With points ``at`` (``(b, t)``:
        sequence ``b`` after its token ``t``) also returns the windows ``[len(at), *window.shape[1:]]`` and
        states ``[len(at), *h.shape[1:]]`` after them, else None."""
        raise NotImplementedError
