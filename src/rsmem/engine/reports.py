"""Reports: what a request has produced so far, as the engine hands it to callers after a step."""

from __future__ import annotations

from rsmem.engine.request import Completion, CompletionOutput, Request, RequestOutput


def report(req: Request) -> RequestOutput:
    """The request's outputs; each completion's ``delta_*`` is what is new since its last report.

    Text that could still grow into a stop string is held back until it cannot, so a cut at a stop
    string never removes text a client has already seen.
    """
    outs = []
    for c in req.completions:
        end = len(c.text) if c.finished else len(c.text) - _stop_prefix_len(c.text, req.params.stop)
        delta_text = c.text[c.reported_chars : end]
        delta_tokens = tuple(c.tokens[c.reported_tokens :])
        c.reported_chars = max(c.reported_chars, end)
        c.reported_tokens = len(c.tokens)
        outs.append(
            CompletionOutput(
                index=c.index,
                text=c.text if c.finished else c.text[:end],
                token_ids=tuple(c.tokens),
                finish_reason=c.finish_reason,
                logprobs=tuple(c.logprobs) if req.params.logprobs is not None else None,
                delta_text=delta_text,
                delta_token_ids=delta_tokens,
                error=c.error,
            )
        )
    error = next((c.error for c in req.completions if c.error is not None), None)
    return RequestOutput(
        req.request_id,
        req.prompt_ids(),
        tuple(outs),
        req.finished,
        req.prompt_text,
        num_cached_tokens=req.n_cached,
        error=error,
        error_kind=req.error_kind if error is not None else None,
    )


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def cut_at_stop(c: Completion, stops: tuple[str, ...], n_new: int) -> bool:
    """Cut the text at the first stop string that the newest text completes; True if one did.

    Reports hold back any tail that could still grow into a stop string, so the cut never removes
    text a client has already seen.
    """
    start = max(0, len(c.text) - n_new - max(map(len, stops)) + 1)
    hits = [i for s in stops if (i := c.text.find(s, start)) >= 0]
    if not hits:
        return False
    c.text = c.text[: min(hits)]
    return True
