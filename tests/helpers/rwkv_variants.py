"""Random ARWKV-7 and QRWKV-6 GGUF files in llama.cpp's layout (``load_arch_tensors`` of its
``llama_model_arwkv7`` and ``llama_model_rwkv6qwen2``), built the same way by the fixture script
(``scripts/make_rwkv_variant_fixtures.py``, which runs llama.cpp on them) and by the tests
(which compare rsmem with what llama.cpp computed)."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from rsmem.loaders.rwkv.vocab import world_vocabulary

N_EMBD, N_LAYER, N_VOCAB, D_FF, HEAD_SIZE, LORA = 128, 2, 300, 256, 64, 32
T = gguf.MODEL_TENSOR


def tensor(kind: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str = ".weight") -> str:
    return gguf.TENSOR_NAMES[kind].format(bid=bid) + suffix


def start(w: gguf.GGUFWriter) -> None:
    """The keys both variants write alike, and a byte World vocabulary of ``N_VOCAB`` tokens."""
    w.add_context_length(1048576)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_token_shift_count(1)
    w.add_head_count(0)
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file = Path(tmp) / "vocab.txt"
        vocab_file.write_text("".join(f"{b + 1} {bytes([b])!r} 1\n" for b in range(256)), encoding="utf-8")
        tok = world_vocabulary(vocab_file, N_VOCAB)
    w.add_tokenizer_model("rwkv")
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)


def finish(w: gguf.GGUFWriter, tensors: dict[str, np.ndarray], path: Path) -> Path:
    for name, data in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_arwkv7_gguf(path: Path, *, gated: bool = True, seed: int = 0) -> Path:
    """A small ARWKV-7 (n_embd 128, 2 layers, head size 64, SwiGLU width 256, 300 tokens of a byte World
    vocabulary): with ``gated``, six lerps, the gate ``g1/g2`` and the WKV output norm; without, five lerps
    and neither. Deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    c, f = N_EMBD, D_FF

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
        return (torch.randn(*shape, generator=g) * scale + shift).numpy()

    w = gguf.GGUFWriter(path, "arwkv7")
    w.add_layer_norm_rms_eps(1e-6)
    w.add_wkv_head_size(HEAD_SIZE)
    w.add_decay_lora_rank(LORA)
    w.add_iclr_lora_rank(LORA)
    w.add_value_residual_mix_lora_rank(LORA)
    w.add_gate_lora_rank(LORA if gated else 0)
    w.add_feed_forward_length(f)
    start(w)
    tensors = {
        tensor(T.TOKEN_EMBD): rnd(N_VOCAB, c),
        tensor(T.OUTPUT_NORM): rnd(c, scale=0.1, shift=1.0),
        tensor(T.OUTPUT): rnd(N_VOCAB, c, scale=c**-0.5),
    }
    for b in range(N_LAYER):
        n_lerp = 6 if gated else 5
        tensors |= {
            tensor(T.ATTN_NORM, b): rnd(c, scale=0.1, shift=1.0),
            tensor(T.TIME_MIX_LERP_FUSED, b): torch.rand(n_lerp, 1, 1, c, generator=g).numpy(),
            tensor(T.TIME_MIX_W0, b): rnd(c, shift=-0.5),
            tensor(T.TIME_MIX_W1, b): rnd(LORA, c, scale=0.1),
            tensor(T.TIME_MIX_W2, b): rnd(c, LORA, scale=0.1),
            tensor(T.TIME_MIX_A0, b): rnd(c, scale=0.5),
            tensor(T.TIME_MIX_A1, b): rnd(LORA, c, scale=0.1),
            tensor(T.TIME_MIX_A2, b): rnd(c, LORA, scale=0.1),
            tensor(T.TIME_MIX_V0, b): rnd(c, scale=0.5, shift=0.5),
            tensor(T.TIME_MIX_V1, b): rnd(LORA, c, scale=0.1),
            tensor(T.TIME_MIX_V2, b): rnd(c, LORA, scale=0.1),
            tensor(T.TIME_MIX_K_K, b): rnd(c, scale=0.1, shift=0.85),
            tensor(T.TIME_MIX_K_A, b): rnd(c, scale=0.1, shift=1.0),
            tensor(T.TIME_MIX_R_K, b): rnd(c, scale=0.1),
            tensor(T.TIME_MIX_KEY, b): rnd(c, c, scale=c**-0.5),
            tensor(T.TIME_MIX_VALUE, b): rnd(c, c, scale=c**-0.5),
            tensor(T.TIME_MIX_RECEPTANCE, b): rnd(c, c, scale=c**-0.5),
            tensor(T.TIME_MIX_OUTPUT, b): rnd(c, c, scale=c**-0.5),
            tensor(T.FFN_NORM, b): rnd(c, scale=0.1, shift=1.0),
            tensor(T.FFN_GATE, b): rnd(f, c, scale=c**-0.5),
            tensor(T.FFN_UP, b): rnd(f, c, scale=c**-0.5),
            tensor(T.FFN_DOWN, b): rnd(c, f, scale=f**-0.5),
        }
        if gated:
            tensors |= {
                tensor(T.TIME_MIX_G1, b): rnd(LORA, c, scale=0.1),
                tensor(T.TIME_MIX_G2, b): rnd(c, LORA, scale=0.1),
                tensor(T.TIME_MIX_LN, b): rnd(c, scale=0.1, shift=1.0),
                tensor(T.TIME_MIX_LN, b, ".bias"): rnd(c, scale=0.1),
            }
    return finish(w, tensors, path)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def random_rwkv6qwen2_gguf(path: Path, *, gqa: bool = False, seed: int = 0) -> Path:
    """A small QRWKV-6 (n_embd 128, 2 layers, head size 64, SwiGLU width 256, mixer rank 32, decay rank 64,
    300 tokens): with ``gqa``, one key/value head for the two heads and receptance/key/value biases; without,
    two key/value heads and no biases. Deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    c, f, e, de = N_EMBD, D_FF, 32, 64
    kv_heads = 1 if gqa else c // HEAD_SIZE
    dkv = kv_heads * HEAD_SIZE

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
        return (torch.randn(*shape, generator=g) * scale + shift).numpy()

    w = gguf.GGUFWriter(path, "rwkv6qwen2")
    w.add_layer_norm_rms_eps(1e-6)
    w.add_wkv_head_size(HEAD_SIZE)
    w.add_time_mix_extra_dim(e)
    w.add_time_decay_extra_dim(de)
    w.add_feed_forward_length(f)
    w.add_head_count_kv(kv_heads)
    start(w)
    tensors = {
        tensor(T.TOKEN_EMBD): rnd(N_VOCAB, c),
        tensor(T.OUTPUT_NORM): rnd(c, scale=0.1, shift=1.0),
        tensor(T.OUTPUT): rnd(N_VOCAB, c, scale=c**-0.5),
    }
    for b in range(N_LAYER):
        tensors |= {
            tensor(T.ATTN_NORM, b): rnd(c, scale=0.1, shift=1.0),
            tensor(T.TIME_MIX_W1, b): rnd(5 * e, c, scale=0.1),
            tensor(T.TIME_MIX_W2, b): rnd(5, c, e, scale=0.1),
            tensor(T.TIME_MIX_LERP_X, b): torch.rand(1, 1, c, generator=g).numpy(),
            tensor(T.TIME_MIX_LERP_FUSED, b): torch.rand(5, 1, 1, c, generator=g).numpy(),
            tensor(T.TIME_MIX_DECAY, b): rnd(c, scale=1.5, shift=-2.5),
            tensor(T.TIME_MIX_DECAY_W1, b): rnd(de, c, scale=0.1),
            tensor(T.TIME_MIX_DECAY_W2, b): rnd(c, de, scale=0.1),
            tensor(T.TIME_MIX_KEY, b): rnd(dkv, c, scale=c**-0.5),
            tensor(T.TIME_MIX_VALUE, b): rnd(dkv, c, scale=c**-0.5),
            tensor(T.TIME_MIX_RECEPTANCE, b): rnd(c, c, scale=c**-0.5),
            tensor(T.TIME_MIX_GATE, b): rnd(c, c, scale=c**-0.5),
            tensor(T.TIME_MIX_OUTPUT, b): rnd(c, c, scale=c**-0.5),
            tensor(T.FFN_NORM, b): rnd(c, scale=0.1, shift=1.0),
            tensor(T.FFN_GATE, b): rnd(f, c, scale=c**-0.5),
            tensor(T.FFN_UP, b): rnd(f, c, scale=c**-0.5),
            tensor(T.FFN_DOWN, b): rnd(c, f, scale=f**-0.5),
        }
        if gqa:
            tensors |= {
                tensor(T.TIME_MIX_RECEPTANCE, b, ".bias"): rnd(c, scale=0.1),
                tensor(T.TIME_MIX_KEY, b, ".bias"): rnd(dkv, scale=0.1),
                tensor(T.TIME_MIX_VALUE, b, ".bias"): rnd(dkv, scale=0.1),
            }
    return finish(w, tensors, path)
