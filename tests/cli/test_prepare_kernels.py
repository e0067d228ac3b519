"""``rsmem serve`` loads the C++ kernels before serving a model whose prompts use them (Mamba-2's scan), so
that no request waits for their first build (the convolution of every model with one, Mamba-2's scan);
other models (RWKV) do not load them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rsmem.cli import model as cli_model
from rsmem.kernels import build


@pytest.mark.parametrize(
    ("arch", "wanted"),
    [
        ("mamba2", True),
        ("nemotron_h", True),
        ("mamba", True),
        ("lfm2", True),
        ("qwen35", True),
        ("rwkv7", False),
    ],
)
def test_serve_prepares_the_kernels_of_models_that_use_them(
    arch: str, wanted: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(build, "native_ops", lambda: calls.append(1) or object())
    assert cli_model.prepare_kernels(SimpleNamespace(arch=arch)) is wanted
    assert calls == ([1] if wanted else [])
    assert ("C++ kernels" in capsys.readouterr().err) is wanted


def test_without_kernels_serving_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "native_ops", lambda: None)
    assert cli_model.prepare_kernels(SimpleNamespace(arch="mamba2")) is False
