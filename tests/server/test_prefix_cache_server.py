"""The prefix cache through the server: a chat turn re-sends the conversation as text, and the tokens
it shares with the previous turn come from checkpoints, whatever slot it lands in."""

from __future__ import annotations

import httpx
import pytest

from helpers.server import LiveServer, start_server

pytestmark = pytest.mark.subprocess

SYSTEM = "You are a player in a company of actors, and you speak in verse. " * 6


def chat(server: LiveServer, messages: list[dict[str, str]], slot: int | None = None) -> dict:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    if slot is not None:
        body["id_slot"] = slot
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_second_chat_turn_in_another_slot_computes_only_what_is_new(shared_llm):
    with start_server(shared_llm, max_tokens_limit=64) as server:
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who art thou?"}]
        first = chat(server, turn1, slot=0)
        answer = first["choices"][0]["message"]["content"]
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And whence?"}]
        second = chat(server, turn2, slot=3)  # another slot: only the shared checkpoints can serve it
        usage1, usage2 = first["usage"], second["usage"]
        cached = usage2["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.95 * usage1["prompt_tokens"], (cached, usage1, usage2)
        # the same conversation without any cache generates the same answer
        with start_server(shared_llm, max_tokens_limit=64, cache_ram=0) as plain:
            expected = chat(plain, turn2)
        assert second["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        assert expected["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = httpx.get(f"{server.url}/metrics").text
        restores = next(
            ln for ln in metrics.splitlines() if ln.startswith("rsmem_checkpoint_restores_total ")
        )
        assert float(restores.split()[1]) >= 1
        assert 'rsmem_prompt_cache_hits_total{kind="rollback"} 0' in metrics
        slot0 = httpx.get(f"{server.url}/slots").json()[0]
        # slot 0 kept turn 1's prompt and answer; the cache holds checkpoints along it (the prompt minus
        # its last token at least), all within what the slot keeps
        assert slot0["checkpoints"] and slot0["checkpoints"] == sorted(slot0["checkpoints"])
        assert usage1["prompt_tokens"] - 1 in slot0["checkpoints"]
        assert max(slot0["checkpoints"]) <= slot0["n_cached_tokens"]
