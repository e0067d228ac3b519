"""Tiny random-weight transformers Mamba / Mamba-2 models, saved as HF folders, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

N_VOCAB = 96  # a multiple of 8 and 16: llama.cpp's vocabulary padding leaves it as is


def build_hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A transformers causal LM with every parameter perturbed (so A_log, D, dt_bias, norms all vary)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    if arch == "mamba":
        cfg = MambaConfig(
            vocab_size=N_VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            intermediate_size=64,
            conv_kernel=4,
            time_step_rank=4,
            tie_word_embeddings=True,
        )
        model = MambaForCausalLM(cfg)
    else:
        cfg = Mamba2Config(
            vocab_size=N_VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=8,
            expand=2,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            tie_word_embeddings=False,
        )
        model = Mamba2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_hf_model(arch: str, folder: Path) -> torch.nn.Module:
    model = build_hf_model(arch)
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def reference_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' full forward over the whole sequence (its cached paths have known faults)."""
    return model(torch.tensor([tokens]), use_cache=False).logits[0].float()
