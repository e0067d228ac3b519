"""BlinkDL ``.pth`` checkpoints (what the ``rwkv`` package loads): read directly (``load_model("x.pth")``)
and converted to GGUF in llama.cpp's layout with the World vocabulary; the GGUF gives the same logits (f32)
or close ones (q8_0), and carries the tokenizer."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import rwkv
import torch

import rsmem
from helpers.rwkv_reference import random_rwkv6, random_rwkv7
from rsmem import Batch, Context
from rsmem.errors import ModelFormatError
from rsmem.loaders import convert_blink_to_gguf

VOCAB = Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"
PROMPT = [72, 102, 109, 109, 112, 33, 120, 112, 115, 109, 101, 257, 258, 290]


def logits(model) -> torch.Tensor:
    ctx = Context(model)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    return ctx.logits


@pytest.mark.parametrize("version", [7, 6])
def test_pth_to_gguf(version: int, tmp_path) -> None:
    sd = (random_rwkv7 if version == 7 else random_rwkv6)(128, 2, 65536 if version == 7 else 300, seed=9)
    pth = tmp_path / "model.pth"
    torch.save(sd, pth)
    direct = rsmem.load_model(pth)
    assert direct.arch == f"rwkv{version}" and direct.tokenizer is None
    want = logits(direct)
    out = convert_blink_to_gguf(pth, tmp_path / "model.gguf", vocab=VOCAB if version == 7 else None)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == f"rwkv{version}"
    assert reader.fields[f"rwkv{version}.wkv.head_size"].contents() == 64
    names = {t.name for t in reader.tensors}
    assert "blk.0.time_mix_lerp_fused.weight" in names and "token_embd_norm.weight" in names
    loaded = rsmem.load_model(out)
    torch.testing.assert_close(logits(loaded), want, rtol=0, atol=1e-6)
    if version == 7:
        assert reader.fields["tokenizer.ggml.model"].contents() == "rwkv"
        assert reader.fields["tokenizer.ggml.eot_token_id"].contents() == 261
        tok = loaded.tokenizer
        assert tok is not None and tok.get_vocab_size() == 65536
        ids = tok.encode("Hello world, 你好\n\n").ids
        assert tok.decode(ids) == "Hello world, 你好\n\n" and ids[-1] == 261
    q8 = rsmem.load_model(convert_blink_to_gguf(pth, tmp_path / "q8.gguf", outtype="q8_0"))
    got = logits(q8)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_bad_inputs_are_one_error(tmp_path) -> None:
    not_rwkv = tmp_path / "other.pth"
    torch.save({"emb.weight": torch.zeros(4, 4)}, not_rwkv)
    with pytest.raises(ModelFormatError, match="version other than 6 or 7"):
        rsmem.load_model(not_rwkv)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a pickle")
    with pytest.raises(ModelFormatError, match="not a loadable"):
        rsmem.load_model(garbage)
    small = tmp_path / "small.pth"
    torch.save(random_rwkv7(128, 1, 300), small)
    with pytest.raises(ModelFormatError, match="65530 tokens for an embedding of 300 rows"):
        convert_blink_to_gguf(small, tmp_path / "x.gguf", vocab=VOCAB)
    with pytest.raises(ValueError, match="outtype"):
        convert_blink_to_gguf(small, tmp_path / "x.gguf", outtype="q4_0")
