"""A ``--kv-unified`` server with its default prompt and prefix caches (issue 37, item 2): idle slots'
cached states give way to a request that fits, so sequential completions of 'a '*100, 'b '*100 and
'a '*100 in 256 shared cells all succeed and ``/health`` stays ``ok`` (the second was a 500 ``no memory
slot for a batch of 199 tokens``, the third ``no free cells to restore a checkpoint``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_hybrid_server import serving

from rsmem.engine import LLM, SamplingParams

pytestmark = pytest.mark.subprocess

PATH = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "lfm2" / "model-f32.gguf"


def test_a_unified_server_serves_requests_that_fit_the_shared_cells():
    llm = LLM(PATH, n_seq_max=2, n_ctx=256, kv_unified=True)
    with serving(llm) as url:  # the defaults: both caches on
        texts = []
        for prompt in ("a " * 100, "b " * 100, "a " * 100):
            body = {"model": "m", "prompt": prompt, "max_tokens": 50, "temperature": 0}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text  # 500 before
            texts.append(r.json()["choices"][0]["text"])
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "ok", health
    assert texts[2] == texts[0]
    alone = LLM(PATH, n_seq_max=1, n_ctx=256)
    assert texts[1] == alone.generate("b " * 100, SamplingParams.greedy(max_tokens=50))[0].outputs[0].text
