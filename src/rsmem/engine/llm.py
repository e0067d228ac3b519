"""``LLM``: the high-level API. Load a model, generate from many prompts at once, or stream one."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import cast

import torch

from rsmem.context import Context
from rsmem.engine.dispatch import Dispatcher
from rsmem.engine.engine import Engine
from rsmem.engine.request import RequestOutput
from rsmem.engine.sampling import SamplingParams
from rsmem.engine.tokenizer import TextTokenizer
from rsmem.models.protocol import RecurrentModel
from rsmem.models.step.compiled import CompileSetting
from rsmem.threads import use_threads

Prompt = str | Sequence[int]
SLOT_CONTEXT = 4096  # KV positions per sequence by default (a hybrid model's attention layers)


def default_model_path() -> Path:
    """The small Shakespeare model shipped inside the package."""
    return Path(str(resources.files("rsmem") / "data" / "default-model.gguf"))


def load_text_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    n_threads: int | None = None,
    compile: CompileSetting = None,
) -> tuple[RecurrentModel, TextTokenizer | None]:
    """A model and its tokenizer (with BOS/EOS ids) from a GGUF file or an HF folder; ``compile`` as in
    :func:`rsmem.load_model`."""
    from rsmem.loaders import build_model, build_tokenizer, read_tensors

    ckpt = read_tensors(path)
    model = build_model(ckpt, dtype, compile)
    use_threads(model, n_threads)  # the thread policy (rsmem.threads): n_threads, RSMEM_THREADS or auto
    tokenizer = None
    if ckpt.tokenizer is not None:
        data = ckpt.tokenizer
        tokenizer = TextTokenizer(build_tokenizer(data), data.bos_id, data.eos_id)
    return model, tokenizer


def model_context_length(model: object) -> int | None:
    """The context length a model was trained for (GGUF ``context_length``), when it declares one."""
    n = getattr(getattr(model, "config", None), "n_ctx_train", None)
    return n if isinstance(n, int) and n > 0 else None


def default_n_ctx(model: object, n_seq_max: int) -> int:
    """KV cells in all by default: ``n_seq_max`` x :data:`SLOT_CONTEXT` positions, or x the model's
    context length when that is smaller (each sequence gets its share; see ``Context``)."""
    per_seq = min(SLOT_CONTEXT, model_context_length(model) or SLOT_CONTEXT)
    return max(1, n_seq_max) * per_seq


class LLM:
    """A model with a context and an engine: ``LLM(path).generate(prompts, SamplingParams(...))``."""

    def __init__(
        self,
        model: str | os.PathLike[str] | RecurrentModel | None = None,
        *,
        tokenizer: TextTokenizer | None = None,
        n_seq_max: int = 8,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        state_dtype: torch.dtype = torch.float32,
        dtype: torch.dtype = torch.float32,
        n_threads: int | None = None,
        compile: CompileSetting = None,
        n_rs_seq: int = 0,
        n_ctx: int | None = None,
        kv_unified: bool = False,
    ) -> None:
        """``n_ctx``, ``kv_unified``: a hybrid model's KV cache (llama.cpp's ``-c`` and ``--kv-unified``):
        ``n_ctx`` cells in all, ``n_ctx / n_seq_max`` (rounded up to 256) for each sequence unless
        unified; None: :func:`default_n_ctx`. A model without attention layers ignores them."""
        if n_ctx is not None and n_ctx < 1:
            raise ValueError(f"n_ctx must be at least 1, got {n_ctx}")
        if model is None or isinstance(model, str | os.PathLike):
            model, loaded_tokenizer = load_text_model(
                default_model_path() if model is None else model,
                dtype=dtype,
                n_threads=n_threads,
                compile=compile,
            )
            tokenizer = tokenizer or loaded_tokenizer
        else:
            use_threads(model, n_threads)
        self.model = model
        self.tokenizer = tokenizer
        self.context = Context(
            model,
            n_seq_max=n_seq_max,
            n_batch=n_batch,
            n_ubatch=n_ubatch or n_batch,
            state_dtype=state_dtype,
            n_rs_seq=n_rs_seq,
            n_ctx=default_n_ctx(model, n_seq_max) if n_ctx is None else n_ctx,
            kv_unified=kv_unified,
        )
        self.engine = Engine(self.context, tokenizer)
        self._dispatch = Dispatcher(self.engine)
        self._worker: ThreadPoolExecutor | None = None  # astream's engine thread, made at first use

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (batched together); outputs in prompt order."""
        one = isinstance(prompts, str) or bool(prompts and isinstance(prompts[0], int))
        many = cast(Sequence[Prompt], [prompts] if one else prompts)
        ids = self._dispatch.submit(lambda engine: engine.add_requests(many, params))
        final: list[RequestOutput] = []
        try:
            for rid in ids:
                *_, last = self._dispatch.reports(rid)
                final.append(last)
        finally:  # interrupted (Ctrl-C): nothing of these requests stays behind
            for rid in ids:
                self._dispatch.close(rid)
        return final

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Generator[RequestOutput, None, None]:
        """Reports of one request as it generates; each carries the new text in ``delta_text``. Any
        number of streams (and :meth:`generate` calls) may run at once, interleaved or from other
        threads: they share the engine's batches, and each gets exactly its own reports."""
        (request_id,) = self._dispatch.submit(lambda engine: [engine.add_request(prompt, params)])
        try:
            yield from self._dispatch.reports(request_id)
        finally:
            self._dispatch.close(request_id)

    async def astream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`stream` for asyncio: the engine steps on one worker thread of this ``LLM``, the loop
        stays free; concurrent ``astream`` tasks share its batches."""
        loop = asyncio.get_running_loop()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rsmem-engine")
        worker = self._worker
        (request_id,) = await loop.run_in_executor(
            worker, self._dispatch.submit, lambda engine: [engine.add_request(prompt, params)]
        )
        try:
            while (
                out := await loop.run_in_executor(worker, self._dispatch.next_report, request_id)
            ) is not None:
                yield out
        finally:
            await loop.run_in_executor(worker, self._dispatch.close, request_id)
