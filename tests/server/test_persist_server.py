"""Persistence through the server (issue 10, item 4): a conversation parked with ``/slots`` save, or kept
in ``--cache-dir``, serves its follow-up turn after a restart computing only the new message.

A restart is a new app over a new engine (the model stays loaded: its memory is cleared when the first
server stops, and nothing of the first engine is reachable from the second)."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest

from helpers.server import LiveServer, start_server
from rsmem.cli.serve import register
from rsmem.errors import RsmemError
from rsmem.memory import checkpoint_file as cf
from rsmem.server import ServeOptions, build_app

pytestmark = pytest.mark.subprocess

SYSTEM = "You are a player in a company of actors, and you speak in verse. " * 6
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who art thou?"}]
NEW = {"role": "user", "content": "And whence comest thou, and whither?"}
# The follow-up may compute, besides the new message as the template renders it ("User: ...\n" and the
# closing "Assistant:"): the answer's last token (a request's final sampled token is never decoded, so no
# state folds it) and the answer's end as the template re-tokenises it ("answer\n" may merge across the
# newline): at most 3 tokens (2 measured with the embedded model).
MARGIN = 3


def chat(server: LiveServer, messages: list[dict[str, str]], slot: int | None = None) -> dict:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0}
    if slot is not None:
        body["id_slot"] = slot
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def slot_action(server: LiveServer, action: str, filename: str) -> dict:
    r = httpx.post(f"{server.url}/slots/0?action={action}", json={"filename": filename}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def new_message_tokens(llm) -> int:
    """The tokens the template adds for NEW after the assistant's answer."""
    return len(llm.tokenizer.encode(f"User: {NEW['content']}\nAssistant:"))


def computed(reply: dict) -> int:
    usage = reply["usage"]
    return usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]


def expected_reply(llm, messages) -> str:
    with start_server(llm, max_tokens_limit=64, cache_ram=0, no_prompt_cache=True) as plain:
        return chat(plain, messages)["choices"][0]["message"]["content"]


def resent(reply: dict) -> str:
    """The answer as a client sends it back: verbatim (it starts with the space the model generated
    after "Assistant:", which the plain template keeps rather than doubling)."""
    return reply["choices"][0]["message"]["content"]


def park_turn1(llm, slots) -> tuple[dict, dict]:
    """Turn one in slot 0, saved to ``talk.bin``; the reply and the save's answer."""
    with start_server(llm, slot_save_path=slots, max_tokens_limit=64) as server:
        first = chat(server, TURN1, slot=0)
        server.wait_idle()
        return first, slot_action(server, "save", "talk.bin")


def test_slot_save_restart_restore_computes_only_the_new_message(shared_llm, tmp_path):
    slots = tmp_path / "slots"
    first, saved = park_turn1(shared_llm, slots)
    assert saved["n_saved"] > 0 and (slots / "talk.bin.ckpt").is_file()
    turn2 = [*TURN1, {"role": "assistant", "content": resent(first)}, NEW]
    with start_server(shared_llm, slot_save_path=slots, max_tokens_limit=64) as server:  # a restart
        assert slot_action(server, "restore", "talk.bin")["n_restored"] == saved["n_saved"]
        second = chat(server, turn2)
    assert computed(second) <= new_message_tokens(shared_llm) + MARGIN, second["usage"]
    assert second["choices"][0]["message"]["content"] == expected_reply(shared_llm, turn2)


def test_after_a_restored_slot_a_regenerate_and_a_verbatim_answer_start_from_checkpoints(
    shared_llm, tmp_path
):
    slots = tmp_path / "slots"
    first, _ = park_turn1(shared_llm, slots)
    verbatim = [*TURN1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}, NEW]
    with start_server(shared_llm, slot_save_path=slots, max_tokens_limit=64) as server:
        slot_action(server, "restore", "talk.bin")
        regenerated = chat(server, TURN1, slot=1)
        answered = chat(server, verbatim, slot=2)
    assert computed(regenerated) == 1, regenerated["usage"]  # the checkpoint before the prompt's last token
    assert regenerated["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    # the verbatim copy renders the tokens the model generated: only the new message is computed
    assert computed(answered) <= new_message_tokens(shared_llm) + MARGIN, answered["usage"]
    assert answered["choices"][0]["message"]["content"] == expected_reply(shared_llm, verbatim)


def test_a_plain_llama_cpp_file_restores_no_checkpoints(shared_llm, tmp_path):
    """The control of the test above: without the companion the regenerate computes every token."""
    slots = tmp_path / "slots"
    first, _ = park_turn1(shared_llm, slots)
    (slots / "talk.bin.ckpt").unlink()
    with start_server(shared_llm, slot_save_path=slots, max_tokens_limit=64) as server:
        slot_action(server, "restore", "talk.bin")
        regenerated = chat(server, TURN1, slot=1)
    assert computed(regenerated) == first["usage"]["prompt_tokens"], regenerated["usage"]


def test_the_cache_dir_serves_the_follow_up_after_a_restart(shared_llm, tmp_path):
    cache = tmp_path / "cache"
    with start_server(shared_llm, cache_dir=cache, max_tokens_limit=64) as server:
        first = chat(server, TURN1)
    turn2 = [*TURN1, {"role": "assistant", "content": resent(first)}, NEW]
    with start_server(shared_llm, cache_dir=cache, max_tokens_limit=64) as server:  # no slot restore
        second = chat(server, turn2)
        regenerated = chat(server, TURN1)
        assert server.engine.checkpoints is not None
        assert server.engine.checkpoints.stats.disk_restores >= 1
        metrics = httpx.get(f"{server.url}/metrics").text
        values = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln[:1] != "#"}
        assert values["rsmem_cache_dir_restores_total"] >= 1 and values["rsmem_cache_dir_checkpoints"] >= 1
        assert values["rsmem_cache_dir_bytes"] > 0 and values["rsmem_cache_dir_corrupt_total"] == 0
    assert computed(second) <= new_message_tokens(shared_llm) + MARGIN, second["usage"]
    assert second["choices"][0]["message"]["content"] == expected_reply(shared_llm, turn2)
    assert computed(regenerated) == 1, regenerated["usage"]


def test_cache_dir_flags_are_parsed_and_checked():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--cache-dir", "ckpts", "--cache-disk", "64"])
    options = ServeOptions.from_args(args)
    assert options.cache_dir is not None and options.cache_dir.name == "ckpts" and options.cache_disk == 64
    options.check()
    for bad, message in (
        ({"cache_disk": -1}, "--cache-disk"),
        ({"cache_ram": 0}, "--cache-dir keeps the prefix cache"),
        ({"no_prompt_cache": True}, "--cache-dir keeps the prefix cache"),
    ):
        with pytest.raises(RsmemError, match=message):
            ServeOptions.from_args(args, **bad).check()


def test_a_corrupt_companion_is_skipped_and_the_slot_restores(shared_llm, tmp_path, caplog):
    slots = tmp_path / "slots"
    first, saved = park_turn1(shared_llm, slots)
    companion = slots / "talk.bin.ckpt"
    data = bytearray(companion.read_bytes())
    data[-100] ^= 0x04
    companion.write_bytes(bytes(data))
    with start_server(shared_llm, slot_save_path=slots, max_tokens_limit=64) as server:
        with caplog.at_level(logging.WARNING, logger="rsmem.kept"):
            assert slot_action(server, "restore", "talk.bin")["n_restored"] == saved["n_saved"]
        regenerated = chat(server, TURN1, slot=1)
    assert "checksum" in caplog.text
    assert computed(regenerated) == first["usage"]["prompt_tokens"]  # nothing of the companion was used
    assert regenerated["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_cache_dir_that_cannot_hold_the_model_folder_is_one_error(shared_llm, tmp_path):
    ctx = shared_llm.context
    folder = cf.model_fingerprint(ctx.model, cf.Layout.of(ctx.memory)).hex()[:16]
    (tmp_path / folder).write_text("a file where the model's folder goes")
    with pytest.raises(RsmemError, match="--cache-dir"):
        build_app(shared_llm, ServeOptions(cache_dir=tmp_path))
