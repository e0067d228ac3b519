"""The RWKV readers' shared metadata access: errors name the key or the architecture."""

from __future__ import annotations

import re

import pytest

from rsmem.errors import ModelFormatError
from rsmem.loaders.rwkv.build import config_from_gguf
from rsmem.loaders.rwkv.keys import ArchKeys, consistent

RWKV7 = {
    "embedding_length": 128,
    "block_count": 2,
    "wkv.head_size": 64,
    "feed_forward_length": 512,
    "attention.decay_lora_rank": 8,
    "attention.iclr_lora_rank": 8,
    "attention.value_residual_mix_lora_rank": 8,
    "attention.gate_lora_rank": 16,
}


def _lookups(meta: dict[str, object]) -> tuple[object, object]:
    def key(k: str) -> object:
        if k not in meta:
            raise ModelFormatError(f"missing key rwkv7.{k}")
        return meta[k]

    return key, meta.get


def test_rwkv7_config_from_keys() -> None:
    key, optional = _lookups(RWKV7 | {"attention.layer_norm_epsilon": 2e-5, "token_shift_count": 2})
    cfg = config_from_gguf("rwkv7", key, 1000, optional)  # type: ignore[arg-type]
    assert (cfg.d_model, cfg.n_layer, cfg.head_size, cfg.d_ff, cfg.n_vocab) == (128, 2, 64, 512, 1000)
    assert cfg.eps == pytest.approx(2e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"token_shift_count": 1}, "rwkv7 needs token_shift_count 2"),
        ({"attention.layer_norm_epsilon": "tiny"}, "'rwkv7.attention.layer_norm_epsilon' is 'tiny'"),
        ({"block_count": True}, "'rwkv7.block_count' is True"),
    ],
)
def test_bad_values_are_named(extra: dict[str, object], message: str) -> None:
    key, optional = _lookups(RWKV7 | extra)
    with pytest.raises(ModelFormatError, match=re.escape(message)):
        config_from_gguf("rwkv7", key, 1000, optional)  # type: ignore[arg-type]


def test_missing_key_raises_from_the_reader() -> None:
    meta = {k: v for k, v in RWKV7.items() if k != "wkv.head_size"}
    key, optional = _lookups(meta)
    with pytest.raises(ModelFormatError, match=re.escape("wkv.head_size")):
        config_from_gguf("rwkv7", key, 1000, optional)  # type: ignore[arg-type]


def test_defaults_and_inconsistency() -> None:
    keys = ArchKeys("rwkv6", lambda k: 3, lambda k: None)
    assert keys.float_or("attention.layer_norm_epsilon", 1e-5) == 1e-5
    assert keys.integer_or("rescale_every_n_layers", 0) == 0
    keys.token_shift(2)  # absent: accepted
    with pytest.raises(ModelFormatError, match="inconsistent hyperparameters"), consistent():
        raise ValueError("d_model 100 is not a multiple of head_size 64")
