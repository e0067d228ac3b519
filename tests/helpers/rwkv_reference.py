"""Random BlinkDL-format RWKV checkpoints and the official ``rwkv`` package (0.8.32) as the reference.

The package picks RWKV-7 or older versions when ``rwkv.model`` is imported (``RWKV_V7_ON``), and tries to
JIT-compile CUDA kernels unless ``RWKV_CUDA_ON=0``; :func:`reference_module` imports its ``model.py`` under
its own name for each version, with the environment set for it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_MODULES: dict[int, ModuleType] = {}


def reference_module(version: int) -> ModuleType:
    """``rwkv/model.py`` imported for RWKV-``version`` (7: ``RWKV_x070``; 6: ``RWKV``), CPU only."""
    if version in _MODULES:
        return _MODULES[version]
    import rwkv  # the installed package: only its folder is used

    os.environ["RWKV_JIT_ON"] = "0"
    os.environ["RWKV_CUDA_ON"] = "0"
    old = os.environ.get("RWKV_V7_ON")
    os.environ["RWKV_V7_ON"] = "1" if version == 7 else "0"
    try:
        path = Path(rwkv.__file__).parent / "model.py"
        spec = importlib.util.spec_from_file_location(f"_rwkv_model_v{version}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        if old is None:
            os.environ.pop("RWKV_V7_ON", None)
        else:
            os.environ["RWKV_V7_ON"] = old
    _MODULES[version] = module
    return module


def random_rwkv7(
    n_embd: int = 128, n_layer: int = 3, n_vocab: int = 300, head_size: int = 64, seed: int = 0, d_ff: int = 0
) -> dict[str, torch.Tensor]:
    """A BlinkDL RWKV-7 state dict with random weights of realistic scales (low-rank dims 32, d_ff 4C)."""
    g = torch.Generator().manual_seed(seed)
    c, f, lr = n_embd, d_ff or 4 * n_embd, 32

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale + shift

    def unif(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g)

    sd: dict[str, torch.Tensor] = {
        "emb.weight": rnd(n_vocab, c),
        "blocks.0.ln0.weight": rnd(c, scale=0.1, shift=1.0),
        "blocks.0.ln0.bias": rnd(c, scale=0.1),
        "ln_out.weight": rnd(c, scale=0.1, shift=1.0),
        "ln_out.bias": rnd(c, scale=0.1),
        "head.weight": rnd(n_vocab, c, scale=c**-0.5),
    }
    for b in range(n_layer):
        p = f"blocks.{b}."
        for ln in ("ln1", "ln2", "att.ln_x"):
            sd[f"{p}{ln}.weight"] = rnd(c, scale=0.1, shift=1.0)
            sd[f"{p}{ln}.bias"] = rnd(c, scale=0.1)
        for x in "rwkvag":
            sd[f"{p}att.x_{x}"] = unif(1, 1, c)
        sd[f"{p}att.w0"] = rnd(1, 1, c, scale=1.0, shift=-0.5)
        sd[f"{p}att.a0"] = rnd(1, 1, c, scale=0.5)
        sd[f"{p}att.v0"] = rnd(1, 1, c, scale=0.5, shift=0.5)
        for lo in ("w", "a", "v", "g"):
            sd[f"{p}att.{lo}1"] = rnd(c, lr, scale=0.1)
            sd[f"{p}att.{lo}2"] = rnd(lr, c, scale=0.1)
        sd[f"{p}att.k_k"] = rnd(1, 1, c, scale=0.1, shift=0.85)
        sd[f"{p}att.k_a"] = rnd(1, 1, c, scale=0.1, shift=1.0)
        sd[f"{p}att.r_k"] = rnd(c // head_size, head_size, scale=0.1)
        for m in ("receptance", "key", "value", "output"):
            sd[f"{p}att.{m}.weight"] = rnd(c, c, scale=c**-0.5)
        sd[f"{p}ffn.x_k"] = unif(1, 1, c)
        sd[f"{p}ffn.key.weight"] = rnd(f, c, scale=c**-0.5)
        sd[f"{p}ffn.value.weight"] = rnd(c, f, scale=f**-0.5)
    return sd


def random_rwkv6(
    n_embd: int = 128, n_layer: int = 3, n_vocab: int = 300, head_size: int = 64, seed: int = 0, d_ff: int = 0
) -> dict[str, torch.Tensor]:
    """A BlinkDL RWKV-6 state dict with random weights (mixer rank 32, decay rank 64, d_ff 3.5C)."""
    g = torch.Generator().manual_seed(seed)
    c, f, e, de = n_embd, d_ff or int(3.5 * n_embd) // 32 * 32, 32, 64

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale + shift

    sd: dict[str, torch.Tensor] = {
        "emb.weight": rnd(n_vocab, c),
        "blocks.0.ln0.weight": rnd(c, scale=0.1, shift=1.0),
        "blocks.0.ln0.bias": rnd(c, scale=0.1),
        "ln_out.weight": rnd(c, scale=0.1, shift=1.0),
        "ln_out.bias": rnd(c, scale=0.1),
        "head.weight": rnd(n_vocab, c, scale=c**-0.5),
    }
    for b in range(n_layer):
        p = f"blocks.{b}."
        for ln in ("ln1", "ln2", "att.ln_x"):
            sd[f"{p}{ln}.weight"] = rnd(c, scale=0.1, shift=1.0)
            sd[f"{p}{ln}.bias"] = rnd(c, scale=0.1)
        for x in "xwkvrg":
            sd[f"{p}att.time_maa_{x}"] = torch.rand(1, 1, c, generator=g)
        sd[f"{p}att.time_maa_w1"] = rnd(c, 5 * e, scale=0.1)
        sd[f"{p}att.time_maa_w2"] = rnd(5, e, c, scale=0.1)
        sd[f"{p}att.time_decay"] = rnd(1, 1, c, scale=1.5, shift=-2.5)  # some channels decay hard
        sd[f"{p}att.time_decay_w1"] = rnd(c, de, scale=0.1)
        sd[f"{p}att.time_decay_w2"] = rnd(de, c, scale=0.1)
        sd[f"{p}att.time_faaaa"] = rnd(c // head_size, head_size, scale=0.5)
        for m in ("receptance", "key", "value", "gate", "output"):
            sd[f"{p}att.{m}.weight"] = rnd(c, c, scale=c**-0.5)
        sd[f"{p}ffn.time_maa_k"] = torch.rand(1, 1, c, generator=g)
        sd[f"{p}ffn.time_maa_r"] = torch.rand(1, 1, c, generator=g)
        sd[f"{p}ffn.key.weight"] = rnd(f, c, scale=c**-0.5)
        sd[f"{p}ffn.receptance.weight"] = rnd(c, c, scale=c**-0.5)
        sd[f"{p}ffn.value.weight"] = rnd(c, f, scale=f**-0.5)
    return sd


def reference_model(sd: dict[str, torch.Tensor], folder: Path, version: int = 7) -> object:
    """The ``rwkv`` package's model of ``sd`` (saved as ``folder/ref.pth``), strategy ``cpu fp32``."""
    path = folder / f"ref-v{version}"
    torch.save(sd, str(path) + ".pth")
    module = reference_module(version)
    cls = module.RWKV_x070 if version == 7 else module.RWKV
    if version == 7:
        return cls(str(path), "cpu fp32")
    return cls(str(path), "cpu fp32", verbose=False)


def clone_state(state: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in state]


def world_vocab() -> list[bytes]:
    """The RWKV World vocabulary as llama.cpp's converter orders it: ``<s>``, then the package's
    ``rwkv_vocab_v20230424.txt`` in file order (ids 1..65529)."""
    import ast

    import rwkv

    tokens = [b"<s>"]
    path = Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split(" ")
        token = ast.literal_eval(" ".join(parts[1:-1]))
        token = token.encode("utf-8") if isinstance(token, str) else token
        assert len(token) == int(parts[-1])
        tokens.append(token)
    return tokens


def write_rwkv_gguf(
    path: Path, arch: str, config: Any, tensors: dict[str, torch.Tensor], vocab: list[bytes]
) -> None:
    """A GGUF file as llama.cpp's converter lays out an RWKV-7 or RWKV-6 model (keys, tensor names and shapes,
    the ``rwkv`` tokenizer with escaped tokens, bos = eos = 0, pads up to the embedding's rows)."""
    import gguf

    from rsmem.loaders.rwkv.tokenizer import escape_rwkv_token

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(1048576)
    w.add_embedding_length(config.d_model)
    w.add_block_count(config.n_layer)
    w.add_layer_norm_eps(config.eps)
    w.add_wkv_head_size(config.head_size)
    if arch == "rwkv7":
        w.add_decay_lora_rank(config.n_lora_decay)
        w.add_iclr_lora_rank(config.n_lora_iclr)
        w.add_value_residual_mix_lora_rank(config.n_lora_value_res_mix)
        w.add_gate_lora_rank(config.n_lora_gate)
    else:
        w.add_rescale_every_n_layers(config.rescale_every_n_layers)
        w.add_time_mix_extra_dim(config.time_mix_extra_dim)
        w.add_time_decay_extra_dim(config.time_decay_extra_dim)
    w.add_feed_forward_length(config.d_ff)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_head_count(0)
    w.add_tokenizer_model("rwkv")
    n_vocab = tensors["token_embd.weight"].shape[0]
    texts = [escape_rwkv_token(t).encode("utf-8") for t in vocab[:n_vocab]]
    types = [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(texts) - 1)
    for i in range(len(texts), n_vocab):
        texts.append(f"[PAD{i}]".encode())
        types.append(gguf.TokenType.UNUSED)
    w.add_token_list(texts)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    for name, t in tensors.items():
        w.add_tensor(name, t.to(torch.float32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
