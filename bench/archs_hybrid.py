"""LFM2 and Nemotron-H for ``bench/throughput.py`` (``--arch lfm2``, ``--arch nemotron_h``).

130M-class random configs, d_model 768, 24 layers, vocabulary 50,288 (tied embedding), f32, with the
attention layers spread among the others as the released models mix them:

- ``lfm2``: 16 short-convolution and 8 attention layers (every third from layer 2, LFM2-350M's share of
  6 in 16), 12 query / 4 KV heads of 64, SwiGLU FFN 1,024 wide, ``L_cache`` 3: ~146M parameters.
- ``nemotron_h``: 11 Mamba-2, 2 attention and 11 squared-ReLU MLP layers, Nemotron-H's alternation of
  mixers and MLPs (``M-M-M-M-M*-M-M-M-M*-M-M-``: attention about one layer in twelve), Mamba-2 with 24
  heads of 64, state 128, one group, conv 4; attention 12 / 4 heads of 64; MLP 3,072 wide: ~138M.

transformers 5.24 builds each with its random initialisation; ``rsmem.convert`` writes the f32 GGUF as
llama.cpp's converter does (checked against llama.cpp's own conversions in
``tests/loaders/test_hybrid_convert.py``) with a byte-level BPE vocabulary (llama.cpp refuses a GGUF without
one). The extra row ``decode1@4096`` decodes one sequence after a 4,096-token prompt: the attention
layers' share of a step grows with the context.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench_arch import BenchArch

D_MODEL, N_LAYER, N_VOCAB = 768, 24, 50288
LFM2_ATTENTION = tuple(range(2, N_LAYER, 3))  # 8 of 24
NEMOTRON_H_PATTERN = "M-M-M-M-M*-M-M-M-M*-M-M-"  # M Mamba-2, * attention, - MLP
NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp"}


def hf_model(arch: str) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=N_VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYER, num_attention_heads=12,
                  num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=16384)  # fmt: skip
    if arch == "lfm2":
        types = ["full_attention" if il in LFM2_ATTENTION else "conv" for il in range(N_LAYER)]
        cfg = transformers.Lfm2Config(
            **common, intermediate_size=1024, block_auto_adjust_ff_dim=False, conv_L_cache=3,
            layer_types=types,
        )  # fmt: skip
        return transformers.Lfm2ForCausalLM(cfg)
    assert len(NEMOTRON_H_PATTERN) == N_LAYER
    cfg = transformers.NemotronHConfig(
        **common,
        intermediate_size=3072,
        layers_block_type=[NEMOTRON_KINDS[k] for k in NEMOTRON_H_PATTERN],
        mamba_num_heads=24,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=1,
        conv_kernel=4,
        head_dim=64,
    )
    return transformers.NemotronHForCausalLM(cfg)


def write_byte_tokenizer(folder: Path, n_vocab: int) -> None:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet and one merge), the last id an end-of-text
    token; rsmem's converter pads the ids between with unused tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = [chr(b) for b in bs] + [chr(256 + n) for n in range(256 - len(bs))]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["Ġt"] = len(vocab)
    spec = {
        "version": "1.0",
        "added_tokens": [{"id": n_vocab - 1, "content": "<|endoftext|>", "special": True}],
        "model": {"type": "BPE", "vocab": vocab, "merges": ["Ġ t"]},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))


def make_build(arch: str):
    def build(folder: Path) -> Path:
        import rsmem

        torch.manual_seed(0)
        hf = hf_model(arch).eval()
        hf_dir = folder / "hf"
        hf.save_pretrained(hf_dir)
        write_byte_tokenizer(hf_dir, N_VOCAB)
        del hf
        return rsmem.convert(hf_dir, folder / f"{arch}-f32.gguf", "f32")

    return build


ARCHS = {arch: BenchArch(build=make_build(arch), rows=("decode1@4096",)) for arch in ("lfm2", "nemotron_h")}
