"""What RWKV-6 and RWKV-7 share (:class:`RwkvModelBase`): the weights held as llama.cpp's RWKV graphs read
them (big matrices through :class:`HeldMatrices`, everything else float32), the compile policy and warm-up,
the one-sequence decode step through one compiled function, and the final norm and head.

A subclass names its layer class (``layer_cls``) and ``matrices``, makes its compiled steps
(:meth:`~RwkvModelBase.make_compiled_steps`: ``_token_one``, one sequence's token, and ``_token_many``, one
token of each of several) and says how the steps read a layer (:meth:`~RwkvModelBase.step_fields`,
:meth:`~RwkvModelBase.step_consts`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.nn.functional as F

from rsmem.models.ops.common import output_rows
from rsmem.models.ops.norm import rms_norm
from rsmem.models.protocol import StateAccess
from rsmem.models.step.compiled import CompiledStep, CompileSetting, resolve_compile
from rsmem.models.step.fused import RowsOperand, SmallRows
from rsmem.models.step.memo import StepMemo
from rsmem.models.step.native import NativeStep
from rsmem.models.step.packed import HeldMatrices
from rsmem.models.step.path import DecodePath, decode_path
from rsmem.models.step.small_rows import many_operand, one_operand
from rsmem.models.step.wkv_many import MANY_OPTIONS

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from rsmem.batch.batch import UBatch

GROUP_NORM_EPS = 64e-5  # the time mix's per-head norm, fixed in llama.cpp and the rwkv package


@dataclass(slots=True)
class RmsBodyWeights:
    """The weights around the blocks of the RWKV variants in a transformer's body (ARWKV-7, QRWKV-6): no
    embedding norm, an RMS output norm (no bias), the head; ``layers`` the model's layer class."""

    embedding: torch.Tensor
    layers: list[Any]
    norm_f: torch.Tensor
    lm_head: torch.Tensor
    emb_norm: None = None
    emb_norm_b: None = None
    norm_f_b: None = None


class RwkvConfig(Protocol):
    """What the shared parts read of ``Rwkv7Config`` / ``Rwkv6Config``."""

    @property
    def d_model(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def head_size(self) -> int: ...
    @property
    def eps(self) -> float: ...
    @property
    def n_head(self) -> int: ...


def token_shift(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The previous token's rows: ``x`` ``[Bs, L, C]`` shifted by one, ``last`` ``[Bs, C]`` first."""
    return torch.cat([last.unsqueeze(1), x[:, :-1]], dim=1)


def vector(t: torch.Tensor | None) -> torch.Tensor:
    """A norm's vector as float32; an absent one (ARWKV-7 has no embedding norm, RMS norms no bias) as an
    empty tensor, which that model never reads."""
    return torch.empty(0) if t is None else t.to(torch.float32)


def state_args(n_fixed: int, per_layer: int) -> Callable[[int], bool]:
    """The arguments a decode step writes: after ``n_fixed`` leading ones, the last two of each layer's
    ``per_layer`` (its token-shift rows and WKV state)."""
    return lambda i: i >= n_fixed and (i - n_fixed) % per_layer >= per_layer - 2


def batch_args(n_fixed: int, per_layer: int, n_layer: int) -> tuple[int, ...]:
    """The arguments of a several-sequence step whose dimension 0 is the batch: the embedding rows (the
    first) and every layer's state rows (see :func:`state_args`)."""
    return (
        0,
        *(n_fixed + il * per_layer + k for il in range(n_layer) for k in (per_layer - 2, per_layer - 1)),
    )


class RwkvModelBase:
    """The parts of :class:`~rsmem.models.rwkv.rwkv7.Rwkv7Model` and
    :class:`~rsmem.models.rwkv.rwkv6.Rwkv6Model`
    that do not depend on the version (see the module)."""

    arch: ClassVar[str]
    matrices: ClassVar[tuple[str, ...]]  # the layer fields held in ``dtype`` as [in, out]
    layer_cls: ClassVar[type[Any]]  # a dataclass of the layer's tensors
    _token_one: CompiledStep[torch.Tensor]
    _token_many: CompiledStep[torch.Tensor]

    def __init__(
        self,
        config: RwkvConfig,
        weights: Any,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ) -> None:
        """``dtype``: the big matrices' and the head's (float32 or bfloat16); everything else is float32.
        ``compile``: whether one-sequence decode steps run compiled (see :meth:`set_compile`)."""
        self.config = config
        self.dtype = dtype
        self.n_vocab = config.n_vocab
        self.n_layer = config.n_layer
        self.n_embd_r = 2 * config.d_model
        self.n_embd_s = config.d_model * config.head_size
        self.tokenizer: Tokenizer | None = None  # set by the loaders when the file carries one
        self.embedding = weights.embedding.to(torch.float32).contiguous()
        self.emb_norm, self.emb_norm_b = vector(weights.emb_norm), vector(weights.emb_norm_b)
        self.norm_f, self.norm_f_b = vector(weights.norm_f), vector(weights.norm_f_b)
        self.held = HeldMatrices(dtype)
        layered = [getattr(ly, name) for ly in weights.layers for name in self.matrices]
        # on huge pages where held as they are (the loader's copies sat on the heap's 4 KiB pages)
        head, *matrices, self.embedding = self.held.on_huge_pages([weights.lm_head, *layered, self.embedding])
        self.lm_head = self.held.hold(head)  # [in, out]
        per_layer = len(self.matrices)
        self.layers = [
            self._held_layer(ly, matrices[il * per_layer : (il + 1) * per_layer])
            for il, ly in enumerate(weights.layers)
        ]
        matrices = [self.lm_head, *(getattr(ly, name) for ly in self.layers for name in self.matrices)]
        self._n_matrix_weights = sum(m.numel() for m in matrices)
        # the compiled step streams [out, in] rows: float32 matrices held as views of them (with packing)
        self._rows_contiguous = all(m.t().is_contiguous() for m in matrices)
        self.compile_decode = False
        self._steps_made = False
        self._native: NativeStep | None = None
        self._flat_memo: StepMemo[list[Any]] = StepMemo()  # the steps' flat operands (steady decode)
        # the WKV kernel's within-chunk part compiled for prefill (made with the compiled steps)
        self.wkv_intra: CompiledStep[tuple[torch.Tensor, ...]] | None = None
        self.set_compile(compile)

    def _held_layer(self, ly: Any, matrices: list[Any]) -> Any:
        """A copy of ``ly``: its matrices (``matrices``, in the order of :attr:`matrices`) held ``[in, out]``
        (:class:`HeldMatrices`), every other tensor float32 (None stays None)."""
        given = dict(zip(self.matrices, matrices, strict=True))
        fields = {
            name: None
            if (t := given.get(name, getattr(ly, name))) is None
            else self.held.hold(t)
            if name in self.matrices
            else t.to(torch.float32).contiguous()
            for name in (f.name for f in dataclasses.fields(self.layer_cls))
        }
        return self.layer_cls(**fields)

    def is_recurrent_layer(self, il: int) -> bool:
        return True

    def set_compile(self, setting: CompileSetting) -> bool:
        """Whether decode steps run compiled (:mod:`rsmem.models.step.compiled`: ``"auto"``, True/False,
        ``"1"``/``"0"``; None reads ``RSMEM_COMPILE``); only with matrices held as float32 ``[out, in]``
        rows. Returns the decision."""
        decided = resolve_compile(setting, self._n_matrix_weights, self.embedding.device)
        self.compile_decode = decided and self._rows_contiguous
        if self.compile_decode and not self._steps_made:
            self._head_one = self.one_operand(self.lm_head)
            self.make_compiled_steps()
            # each layer's weights as the steps take them (made once: too costly to build every step)
            self._fields_one = [self.step_fields(ly, self.one_operand) for ly in self.layers]
            self._fields_many = [self.step_fields(ly, self.rows_operand) for ly in self.layers]
            self._head_many = self.rows_operand(self.lm_head)
            self._native = self.native_step()
            self._steps_made = True
        return self.compile_decode

    def rows_operand(self, weight_t: torch.Tensor) -> RowsOperand:
        """A held ``[in, out]`` matrix as several sequences' step takes it
        (:func:`~rsmem.models.step.small_rows.many_operand`)."""
        return many_operand(weight_t, self.held.packed.twin(weight_t))

    def one_operand(self, weight_t: torch.Tensor) -> torch.Tensor | SmallRows:
        """A held ``[in, out]`` matrix as the one-sequence step takes it
        (:func:`~rsmem.models.step.small_rows.one_operand`; :func:`~rsmem.models.step.wkv_fused.one_row`)."""
        return one_operand(weight_t, self.held.packed.twin(weight_t))

    def one_options(self) -> dict[str, Any] | None:
        """Inductor options of the one-sequence step: with the big products in the few-row kernel (each
        on every thread, one parallel region a product) every inductor kernel runs on one thread (no
        hand-off to a sleeping partner for a norm or a low-rank mixer); else inductor's defaults (its
        reductions are then the products, parallel)."""
        return MANY_OPTIONS if isinstance(self._head_one, SmallRows) else None

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """The protocol's forward (the subclasses')."""
        raise NotImplementedError

    def make_compiled_steps(self) -> None:
        """Create the compiled steps (``_token_one``: one sequence's whole token; ``_token_many``: one token
        of each of several sequences; ``wkv_intra``: the prefill kernel's within-chunk part)."""
        raise NotImplementedError

    def prefill_intra(self) -> CompiledStep[tuple[torch.Tensor, ...]] | None:
        """The compiled within-chunk part of the WKV prefill kernel when decode steps are compiled, else
        None (the kernel's eager one)."""
        return self.wkv_intra if self.compile_decode else None

    def warm_up(self) -> float:
        """Compile the steps now on a scratch memory (a prompt, one sequence's token, a token of two
        sequences); the seconds it took (0: not compiling)."""
        if not self.compile_decode:
            return 0.0
        from rsmem.batch.batch import Batch  # here: rsmem.context imports the models package
        from rsmem.context import Context

        started = time.perf_counter()
        Context(self).decode(Batch([1, 2]))
        Context(self).decode(Batch([1]))
        Context(self, n_seq_max=2).decode(Batch([1, 2], seq_ids=[[0], [1]], logits=[True, True]))
        return time.perf_counter() - started

    def native_step(self) -> NativeStep | None:
        """The architecture's decode step in C++ (RWKV-7), else None."""
        return None

    def step_fields(self, ly: Any, operand: Callable[[torch.Tensor], Any]) -> list[Any]:
        """The layer's tensors in the order the steps take them, each of :attr:`matrices` as ``operand``
        gives it (``[out, in]`` for one sequence, :meth:`rows_operand` for several)."""
        raise NotImplementedError

    def step_consts(self) -> tuple[float | int, ...]:
        """The step's arguments after ``lm_head``, before the layers' tensors."""
        raise NotImplementedError

    def step_flat(self, fields: list[list[Any]], rows: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
        """Each layer's ``fields`` then its float32 state ``rows`` shaped as the steps take them, as one list;
        kept while the rows are the same views (:class:`StepMemo`)."""

        def build() -> list[Any]:
            cfg, n_seqs = self.config, rows[0][0].shape[0]
            views = [
                (r.view(n_seqs, 2, cfg.d_model), s.view(n_seqs, cfg.n_head, cfg.head_size, cfg.head_size))
                for r, s in rows
            ]
            return [t for f, v in zip(fields, views, strict=True) for t in (*f, *v)]

        return self._flat_memo.get((fields, *rows), build)

    def decode_path(self, n_seqs: int) -> DecodePath:
        """:func:`~rsmem.models.step.native.decode_path` of this model: its C++ step runs only where the
        steps are compiled (which takes contiguous rows)."""
        return decode_path(
            self._native,
            n_seqs,
            compiled=self.compile_decode,
            rows_contiguous=self._rows_contiguous,
            native_without_compile=False,
        )

    def decode_one(self, token: torch.Tensor, states: StateAccess) -> torch.Tensor | None:
        """One token of one sequence through the compiled step; None (nothing written) when the state rows
        are not float32."""
        return self._decode_compiled(self._token_one, self._fields_one, self._head_one, token, states)

    def decode_many(self, tokens: torch.Tensor, states: StateAccess) -> torch.Tensor | None:
        """One token of each of several sequences (``tokens`` ``[Bs]``) through the compiled step; None
        (nothing written) when the state rows are not float32."""
        return self._decode_compiled(self._token_many, self._fields_many, self._head_many, tokens, states)

    def _decode_compiled(
        self,
        step: CompiledStep[torch.Tensor],
        fields: list[list[Any]],
        lm_head: Any,
        tokens: torch.Tensor,
        states: StateAccess,
    ) -> torch.Tensor | None:
        """Logits ``[Bs, n_vocab]`` of ``step`` on one token of each sequence (``tokens`` ``[Bs]``), with
        each layer's ``fields`` and its state rows, which it updates."""
        cfg = self.config
        rows = [states.read_states(il) for il in range(self.n_layer)]
        if any(r.dtype != torch.float32 or s.dtype != torch.float32 for r, s in rows):
            return None  # the compiled steps take float32 only
        x = self.embedding[tokens]
        logits = None
        native = self._native
        if native is not None and self.decode_path(x.shape[0]) == "native":  # on the one-sequence operands
            flat, head = self.step_flat(self._fields_one, rows), self._head_one
            if native.accepts(head, flat) and native.check(x, self.norm_f, head, cfg.eps, flat):
                logits = native.run(x, self.norm_f, head, cfg.eps, flat)
        if logits is None:  # no C++ step, its check failed, or an operand it does not take
            flat = self.step_flat(fields, rows)
            logits = step(
                x,
                self.emb_norm,
                self.emb_norm_b,
                self.norm_f,
                self.norm_f_b,
                lm_head,
                *self.step_consts(),
                *flat,
            )
        per_layer = len(flat) // self.n_layer
        for il in range(self.n_layer):
            states.write_states(il, flat[(il + 1) * per_layer - 2], flat[(il + 1) * per_layer - 1])
        return logits

    @staticmethod
    def output_logits(logits: torch.Tensor, ubatch: UBatch) -> torch.Tensor:
        """The rows of a decode step's logits (one a sequence) that the micro-batch wants."""
        rows = ubatch.output_rows()
        if len(rows) == logits.shape[0]:
            return logits
        return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))

    def head(self, x: torch.Tensor, ubatch: UBatch) -> torch.Tensor:
        """Logits of the micro-batch's output rows of ``x``: final norm, LM head."""
        cfg = self.config
        x = output_rows(x, ubatch.output_rows())
        x = F.layer_norm(x, (cfg.d_model,), self.norm_f, self.norm_f_b, cfg.eps)
        return self.held.linear(x, self.lm_head)


class RmsBodyMixin:
    """The body of ARWKV-7 and QRWKV-6 (mixed into their model classes, before the RWKV class): per layer
    ``x += time_mix(rms_norm(x))`` with one token-shift row, then ``x += down(silu(gate f) * up f)`` with
    ``f = rms_norm(x)``; the RMS output norm and head. Eager decode (no compiled step). The model supplies
    :meth:`body_mix`: ``(layer, h, prev, wkv, carry) -> (out, carry)`` (``carry``: RWKV-7's first-layer
    values, None before the first layer)."""

    config: Any
    layers: list[Any]
    held: HeldMatrices
    embedding: torch.Tensor
    norm_f: torch.Tensor
    lm_head: torch.Tensor
    compile_decode: bool

    def set_compile(self, setting: CompileSetting) -> bool:
        """No compiled step: decode runs eagerly (returns False)."""
        self.compile_decode = False
        return False

    def body_mix(
        self, ly: Any, h: torch.Tensor, prev: torch.Tensor, wkv: torch.Tensor, carry: Any
    ) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; reads and writes each layer's states."""
        cfg = self.config
        tokens = ubatch.token_tensor()  # [Bs, L]
        n_seqs = tokens.shape[0]
        x = self.embedding[tokens]
        linear = self.held.linear
        carry: Any = None
        for il, ly in enumerate(self.layers):
            r_rows, s_rows = states.read_states(il)
            shift = r_rows.view(n_seqs, cfg.d_model).float()
            wkv = s_rows.view(n_seqs, cfg.n_head, cfg.head_size, cfg.head_size)
            wkv = wkv if wkv.dtype == torch.float32 else wkv.float()
            h = rms_norm(x, ly.attn_norm, cfg.eps)
            out, carry = self.body_mix(ly, h, token_shift(h, shift), wkv, carry)
            x = x + out
            f = rms_norm(x, ly.ffn_norm, cfg.eps)
            x = x + linear(F.silu(linear(f, ly.ffn_gate)) * linear(f, ly.ffn_up), ly.ffn_down)
            states.write_states(il, h[:, -1], wkv)
        x = output_rows(x, ubatch.output_rows())
        return linear(rms_norm(x, self.norm_f, cfg.eps), self.lm_head)
