"""Slot files: a length limit, errors that name no server path, and no restore of a non-finite state."""

from __future__ import annotations

import math
import struct

import httpx
import pytest

from helpers.server import MODEL, LiveServer

pytestmark = pytest.mark.subprocess


def slot_post(live: LiveServer, slot: int, action: str, filename: str | None) -> httpx.Response:
    body = {"filename": filename} if filename is not None else None
    return httpx.post(f"{live.url}/slots/{slot}?action={action}", json=body)


def assert_clean_400(live: LiveServer, r: httpx.Response) -> str:
    """A 400 error object whose message names no server path and carries no traceback."""
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    folder = str(live.settings.slot_save_path)
    assert folder not in message and str(live.settings.slot_save_path.resolve()) not in message
    assert "Traceback" not in message and "/tmp" not in message
    return message


def fill_slot(live: LiveServer, slot: int) -> None:
    body = {"model": MODEL, "prompt": "HAMLET: To", "max_tokens": 4, "temperature": 0, "id_slot": slot}
    assert httpx.post(f"{live.base_url}/completions", json=body).status_code == 200


@pytest.mark.parametrize("action", ["save", "restore"])
def test_long_filenames_are_a_clean_400(live, action):
    for name in ("a" * 300, "b" * 201, "c" * 5000):
        message = assert_clean_400(live, slot_post(live, 0, action, name))
        assert "200" in message and name not in message  # the limit, not the whole name


def test_a_200_character_filename_is_accepted(live):
    fill_slot(live, 0)
    name = "s" * 196 + ".bin"
    saved = slot_post(live, 0, "save", name)
    assert saved.status_code == 200, saved.text
    assert slot_post(live, 0, "restore", name).status_code == 200


def test_restore_errors_name_no_path(live):
    (live.settings.slot_save_path / "garbage.bin").write_bytes(b"not a state file at all")
    assert_clean_400(live, slot_post(live, 1, "restore", "garbage.bin"))
    assert_clean_400(live, slot_post(live, 1, "restore", "missing.bin"))
    assert_clean_400(live, slot_post(live, 1, "restore", None))
    r = slot_post(live, 99, "restore", "garbage.bin")
    assert_clean_400(live, r)
    assert r.json()["error"]["param"] in ("id_slot", "filename")


def test_restoring_a_non_finite_state_is_a_400_and_changes_nothing(live):
    fill_slot(live, 2)
    assert slot_post(live, 2, "save", "good.bin").status_code == 200
    data = bytearray((live.settings.slot_save_path / "good.bin").read_bytes())
    data[-16:] = struct.pack("<4f", math.nan, math.nan, math.inf, math.nan)  # the last layer's state rows
    (live.settings.slot_save_path / "nan.bin").write_bytes(bytes(data))
    httpx.post(f"{live.url}/slots/3?action=erase")
    message = assert_clean_400(live, slot_post(live, 3, "restore", "nan.bin"))
    assert "non-finite" in message or "NaN" in message
    slots = httpx.get(f"{live.url}/slots").json()
    assert slots[3]["n_cached_tokens"] == 0 and not slots[3]["busy"]
    r = httpx.post(
        f"{live.base_url}/completions",
        json={"model": MODEL, "prompt": "HAMLET: To", "max_tokens": 4, "temperature": 0, "id_slot": 3},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
