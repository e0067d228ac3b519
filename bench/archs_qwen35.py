"""Qwen3.5 for ``bench/throughput.py`` (``--arch qwen35``).

A 130M-class random ``Qwen3_5ForCausalLM`` (transformers 5.24), laid out as Qwen3.5's small models are:
d_model 768, 24 layers, every fourth a gated full attention layer (``linear, linear, linear, full``: 18
gated delta nets, 6 attention layers), delta nets with 8 key heads and 16 value heads of 64 (conv 4),
attention 8 query / 2 KV heads of 128 with a quarter of each head rotated, SwiGLU FFN 1,024 wide,
vocabulary 50,288, tied embedding: ~169M parameters. ``rsmem.convert`` writes the f32 GGUF (llama.cpp's
converter's transforms; checked against llama.cpp's own conversion by the fixture in
``tests/fixtures/llamacpp/qwen35``) with a byte-level BPE vocabulary. The extra row ``decode1@4096`` decodes
one sequence after a 4,096-token prompt.
"""

from __future__ import annotations

from pathlib import Path

import torch

from archs_hybrid import write_byte_tokenizer
from bench_arch import BenchArch

D_MODEL, N_LAYER, N_VOCAB = 768, 24, 50288
LAYER_TYPES = ["full_attention" if il % 4 == 3 else "linear_attention" for il in range(N_LAYER)]


def hf_model() -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=N_VOCAB,
        hidden_size=D_MODEL,
        num_hidden_layers=N_LAYER,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=1024,
        layer_types=LAYER_TYPES,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
        max_position_embeddings=16384,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    )
    return transformers.Qwen3_5ForCausalLM(cfg)


def build(folder: Path) -> Path:
    import rsmem

    torch.manual_seed(0)
    hf = hf_model().eval()
    hf_dir = folder / "hf"
    hf.save_pretrained(hf_dir)
    write_byte_tokenizer(hf_dir, N_VOCAB)
    del hf
    return rsmem.convert(hf_dir, folder / "qwen35-f32.gguf", "f32")


ARCHS = {"qwen35": BenchArch(build=build, rows=("decode1@4096",))}
