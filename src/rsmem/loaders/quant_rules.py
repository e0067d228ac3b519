"""Which type each tensor gets when a GGUF file is quantized: llama.cpp's rules (src/llama-quant.cpp:
``tensor_allows_quantization``, ``llama_tensor_get_type`` and ``tensor_type_fallback``), for the presets
``rsmem quantize`` offers, with llama.cpp's default parameters (no imatrix, no overrides, output quantized).

- Only tensors of two or more (ggml) dimensions whose name ends in ``weight`` are quantized; norms, the
  SSM and short-convolution kernels (``ssm_conv1d``, ``shortconv.conv``), RWKV's small 2-D tensors and a few
  others keep their type. ``ssm_a``, ``ssm_d`` and biases do not end in ``weight``.
- For the quantized presets: ``output.weight`` (and ``token_embd.weight`` when the output is tied to it)
  becomes Q6_K unless the preset's type is Q8_0 or its rows do not fit the preset's blocks (then Q8_0);
  the ``_m`` presets give more bits to ``attn_v`` / ``ffn_down`` in the layers llama.cpp's
  ``use_more_bits`` picks, ``q4_k_s`` makes the first ``attn_v`` and ``ffn_down`` layers Q5_K, and the
  ``q2_k`` / ``q3_k_*`` presets raise ``attn_v``, ``ffn_down`` and ``attn_output`` one or two steps.
- A row that is not a whole number of the chosen type's blocks falls back: Q2_K, Q3_K -> Q4_0,
  Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and to F16 if that does not fit either.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import gguf

Q = gguf.GGMLQuantizationType
LFT = gguf.LlamaFileType


@dataclass(frozen=True, slots=True)
class Preset:
    """One ``--type``: the file type written to ``general.file_type`` and the default tensor type."""

    name: str
    file_type: gguf.LlamaFileType
    default: gguf.GGMLQuantizationType


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("f32", LFT.ALL_F32, Q.F32),
        Preset("f16", LFT.MOSTLY_F16, Q.F16),
        Preset("bf16", LFT.MOSTLY_BF16, Q.BF16),
        Preset("q8_0", LFT.MOSTLY_Q8_0, Q.Q8_0),
        Preset("q4_0", LFT.MOSTLY_Q4_0, Q.Q4_0),
        Preset("q4_1", LFT.MOSTLY_Q4_1, Q.Q4_1),
        Preset("q5_0", LFT.MOSTLY_Q5_0, Q.Q5_0),
        Preset("q5_1", LFT.MOSTLY_Q5_1, Q.Q5_1),
        Preset("q2_k", LFT.MOSTLY_Q2_K, Q.Q2_K),
        Preset("q3_k_s", LFT.MOSTLY_Q3_K_S, Q.Q3_K),
        Preset("q3_k_m", LFT.MOSTLY_Q3_K_M, Q.Q3_K),
        Preset("q3_k_l", LFT.MOSTLY_Q3_K_L, Q.Q3_K),
        Preset("q4_k_s", LFT.MOSTLY_Q4_K_S, Q.Q4_K),
        Preset("q4_k_m", LFT.MOSTLY_Q4_K_M, Q.Q4_K),
        Preset("q5_k_s", LFT.MOSTLY_Q5_K_S, Q.Q5_K),
        Preset("q5_k_m", LFT.MOSTLY_Q5_K_M, Q.Q5_K),
        Preset("q6_k", LFT.MOSTLY_Q6_K, Q.Q6_K),
    )
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)

# substrings of names llama.cpp never quantizes (tensor_allows_quantization, the architectures rsmem has
# and the generic ones)
_KEEP_SUBSTRINGS = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
)
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")
# tensor_get_category: the first match wins
_CATEGORIES = (
    ("attn_qkv.weight", "attn_qkv"),
    ("attn_kv_b.weight", "attn_kv_b"),
    ("attn_v.weight", "attn_v"),
    ("attn_k.weight", "attn_k"),
    ("attn_q.weight", "attn_q"),
    ("attn_output.weight", "attn_output"),
    ("ffn_up", "ffn_up"),
    ("ffn_gate", "ffn_gate"),
    ("ffn_down", "ffn_down"),
)
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_LAYER = re.compile(r"blk\.\s*([+-]?\d+)")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the rules look at: the name, ggml's shape (``ne``, row length first) and the stored type."""

    name: str
    ne: tuple[int, ...]
    type: gguf.GGMLQuantizationType


def llama_order(names: Sequence[str]) -> list[str]:
    """The names in the order llama.cpp's quantizer writes them: tensors outside ``blk.N.`` first, then by
    layer number, by name (bytes) within a layer."""

    def key(name: str) -> tuple[int, bytes]:
        m = _LAYER.match(name)
        return (int(m.group(1)) if m else -1, name.encode())

    return sorted(names, key=key)


def ggml_n_dims(ne: Sequence[int]) -> int:
    """ggml's dimension count: trailing 1s do not count, and a tensor has at least one dimension."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return max(n, 1)


def allows_quantization(t: TensorSpec) -> bool:
    if ggml_n_dims(t.ne) < 2 or not t.name.endswith("weight"):
        return False
    if t.name in _KEEP_NAMES:
        return False
    return not any(s in t.name for s in _KEEP_SUBSTRINGS)


def category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for pattern, cat in _CATEGORIES:
        if pattern in name:
            return cat
    return "other"


def _block(qtype: gguf.GGMLQuantizationType) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The hyperparameters the rules read: the block count and layer 0's query heads per KV head (0 when
    layer 0 has no attention, as llama.cpp's ``n_gqa()``)."""

    n_layer: int
    n_gqa: int = 0


class _Chooser:
    """llama_tensor_get_type_impl's state: the attn_v and ffn_down counters, in the order tensors come."""

    def __init__(self, preset: Preset, tensors: Sequence[TensorSpec], info: ModelInfo) -> None:
        self.preset = preset
        cats = [category(t.name) for t in tensors]
        self.tied = "output" not in cats
        self.n_attention_wv = sum(c in ("attn_v", "attn_qkv", "attn_kv_b") for c in cats)
        self.i_attention_wv = 0
        self.info = info
        self.i_ffn_down = 0

    def choose(self, t: TensorSpec) -> gguf.GGMLQuantizationType:
        new = self.preset.default
        cat = category(t.name)
        if cat == "output" or (self.tied and cat == "token_embd"):
            if t.ne[0] % _block(new) != 0:
                new = Q.Q8_0
            elif new != Q.Q8_0:
                new = Q.Q6_K
        elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):  # llama.cpp's attn_qkv branch comes after this one
            new = self._attn_v(new)
            self.i_attention_wv += 1
        elif cat == "ffn_down":
            new = self._ffn_down(new)
            self.i_ffn_down += 1
        elif cat == "attn_output":
            new = {"q2_k": Q.Q3_K, "q3_k_m": Q.Q4_K, "q3_k_l": Q.Q5_K}.get(self.preset.name, new)
        return new

    def _attn_v(self, new: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        name, i, n = self.preset.name, self.i_attention_wv, self.n_attention_wv
        if name == "q2_k":
            return Q.Q4_K if self.info.n_gqa >= 4 else Q.Q3_K
        if name == "q3_k_m":
            return Q.Q5_K if i < 2 else Q.Q4_K
        if name == "q3_k_l":
            return Q.Q5_K
        if name in ("q4_k_m", "q5_k_m") and _use_more_bits(i, n):
            return Q.Q6_K
        if name == "q4_k_s" and i < 4:
            return Q.Q5_K
        return new

    def _ffn_down(self, new: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        name, i, n = self.preset.name, self.i_ffn_down, self.info.n_layer
        if name == "q2_k":
            return Q.Q3_K
        if name == "q3_k_m":  # (Falcon aside) the first sixteenth Q5_K, the rest Q4_K
            return Q.Q5_K if i < n // 16 else Q.Q4_K
        if name == "q3_k_l":
            return Q.Q5_K
        if name == "q4_k_m":
            return Q.Q6_K if _use_more_bits(i, n) else new
        if name == "q5_k_m" and _use_more_bits(i, n):
            return Q.Q6_K
        if name == "q4_k_s" and i < n // 8:
            return Q.Q5_K
        return new


def _fallback(t: TensorSpec, qtype: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    if t.ne[0] % _block(qtype) == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if t.ne[0] % _block(qtype) == 0 else Q.F16


def target_types(
    preset: Preset, tensors: Sequence[TensorSpec], info: ModelInfo
) -> dict[str, gguf.GGMLQuantizationType]:
    """Each tensor's type in the quantized file, by name; ``tensors`` in llama.cpp's order (the counters
    of the ``_m`` presets follow it)."""
    chooser = _Chooser(preset, tensors, info)
    out: dict[str, gguf.GGMLQuantizationType] = {}
    for t in tensors:
        if not allows_quantization(t):
            out[t.name] = t.type
        elif preset.default in FLOAT_TYPES:
            out[t.name] = preset.default
        else:
            out[t.name] = _fallback(t, chooser.choose(t))
    return out
