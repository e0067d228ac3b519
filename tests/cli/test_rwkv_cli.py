"""The command line on RWKV models: ``rsmem info`` describes them, ``rsmem convert`` takes BlinkDL ``.pth``
checkpoints (with ``--vocab`` for the World tokenizer), and loading a model that compiles its decode steps
compiles them up front (announced) rather than silently at the first token."""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import rsmem
from helpers.rwkv_reference import random_rwkv6, random_rwkv7
from rsmem import Batch, Context
from rsmem.cli import main
from rsmem.cli.model import add_model_options, load
from rsmem.models.rwkv.rwkv6 import Rwkv6Model
from rsmem.models.rwkv.rwkv7 import Rwkv7Model

pytestmark = pytest.mark.compiled

FIXTURES = Path(__file__).parents[1] / "fixtures" / "llamacpp" / "rwkv"
PROMPT = [72, 102, 109, 109, 112, 33, 120, 112, 115, 109, 101, 257, 258, 290]

# ----------------------------------------------------------------------------- warm-up at load


@pytest.mark.parametrize(("arch", "cls"), [("rwkv7", Rwkv7Model), ("rwkv6", Rwkv6Model)])
@pytest.mark.parametrize("flag", ["1", "0"])
def test_load_compiles_rwkv_decode_steps_up_front(arch, cls, flag, monkeypatch, capsys) -> None:
    calls: list[object] = []

    def fake_warm_up(self: object) -> float:  # compiling for real takes minutes on this machine
        calls.append(self)
        return 1.25

    monkeypatch.setattr(cls, "warm_up", fake_warm_up)
    parser = argparse.ArgumentParser()
    add_model_options(parser)
    args = parser.parse_args(["-m", str(FIXTURES / arch / "model-f32.gguf"), "-t", "1", "--compile", flag])
    llm = load(args, n_seq_max=1)
    err = capsys.readouterr().err
    assert isinstance(llm.model, cls) and llm.model.compile_decode == (flag == "1")
    if flag == "1":
        assert calls == [llm.model]
        assert "[compiling decode steps" in err and "[compiled in 1.2 s]" in err
    else:
        assert calls == [] and "compil" not in err


# ----------------------------------------------------------------------------- info


def info_lines(path: Path, capsys) -> dict[str, str]:
    assert main(["info", str(path)]) == 0
    lines: dict[str, str] = {}
    for line in capsys.readouterr().out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() and not key.startswith(" "):
            lines[key.strip()] = value.strip()
    return lines


@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_info_describes_rwkv_models(arch, capsys) -> None:
    path = FIXTURES / arch / "model-f32.gguf"
    info = info_lines(path, capsys)
    assert info["architecture"] == arch
    assert (info["d_model"], info["n_layer"], info["head_size"], info["n_head"]) == ("128", "2", "64", "2")
    per_layer = (2 * 128 + 128 * 64) * 4  # token-shift rows and WKV state, f32
    assert info["state per seq"].startswith(f"{2 * per_layer} bytes")
    assert info["state per layer"] == f"r {2 * 128} + s {128 * 64} floats"
    n_values = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors)
    assert info["parameters"] == f"{n_values / 1e6:.2f} M"
    assert info["tensor types"].startswith("F32") and "tensors" in info["tensor types"]
    assert info["tokenizer"].startswith("300 tokens")
    assert main(["info", str(path)]) == 0
    layout = "[H, K, V]" if arch == "rwkv6" else "[H, V, K]"
    assert f"s: WKV {layout} = 2 x 64 x 64" in capsys.readouterr().out


# ----------------------------------------------------------------------------- convert


def write_vocab(path: Path) -> list[bytes]:
    """A small vocabulary file in the World format (``id repr(token) length``): the 256 bytes, then a few
    longer tokens; 261 tokens, so a 300-row embedding holds them with ``<s>`` and padding."""
    tokens = [bytes([b]) for b in range(256)] + [b"\n\n", b"Hello", b" world", "你好".encode(), b"\xe4\xbd"]
    lines = []
    for i, tok in enumerate(tokens, start=1):
        try:
            shown = repr(tok.decode("utf-8"))
        except UnicodeDecodeError:
            shown = repr(tok)
        lines.append(f"{i} {shown} {len(tok)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tokens


def logits(model) -> torch.Tensor:
    ctx = Context(model)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    return ctx.logits


@pytest.mark.parametrize("version", [7, 6])
def test_convert_pth_with_vocab(version, tmp_path, capsys) -> None:
    sd = (random_rwkv7 if version == 7 else random_rwkv6)(128, 1, 300, seed=4)
    pth = tmp_path / "model.pth"
    torch.save(sd, pth)
    vocab = tmp_path / "vocab.txt"
    write_vocab(vocab)
    out = tmp_path / "model.gguf"
    assert main(["convert", str(pth), str(out), "--outtype", "f32", "--vocab", str(vocab)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == f"rwkv{version}"
    assert reader.fields["tokenizer.ggml.model"].contents() == "rwkv"
    converted = rsmem.load_model(out)
    torch.testing.assert_close(logits(converted), logits(rsmem.load_model(pth)), rtol=0, atol=1e-6)
    tok = converted.tokenizer
    assert tok is not None and tok.get_vocab_size() == 300
    ids = tok.encode("Hello world 你好\n\n").ids
    assert ids == [258, 259, 33, 260, 257] and tok.decode(ids) == "Hello world 你好\n\n"
    # --outtype as for other conversions: q8_0 matrices, no tokenizer without --vocab (said so)
    q8 = tmp_path / "q8.gguf"
    assert main(["convert", str(pth), str(q8), "--outtype", "q8_0"]) == 0
    assert "no --vocab" in capsys.readouterr().err
    reader = gguf.GGUFReader(q8)
    assert "tokenizer.ggml.model" not in reader.fields
    assert gguf.GGMLQuantizationType.Q8_0 in {t.tensor_type for t in reader.tensors}


def test_convert_errors_are_one_line(tmp_path, capsys) -> None:
    pth = tmp_path / "model.pth"
    torch.save(random_rwkv7(128, 1, 300), pth)
    assert main(["convert", str(pth), str(tmp_path / "x.gguf"), "--vocab", str(tmp_path / "none.txt")]) == 1
    assert capsys.readouterr().err == f"rsmem: error: --vocab {tmp_path / 'none.txt'}: no such file\n"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert main(["convert", str(folder), str(tmp_path / "x.gguf"), "--vocab", str(pth)]) == 1
    assert "only for RWKV .pth checkpoints" in capsys.readouterr().err
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a pickle")
    assert main(["convert", str(bad), str(tmp_path / "x.gguf")]) == 1
    assert "not a loadable .pth checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
