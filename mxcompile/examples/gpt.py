"""A small byte-level GPT used by the demo, the tests and the benchmarks.

Every GEMM lives in an `nn.Linear` (fused qkv, attention output projection, MLP up and down
projections, LM head), and with the preset sizes every linear's `in_features` is a multiple
of 32, so each one is eligible for MX GEMMs. Module names are stable, for `MXConfig`'s
include/exclude regexes:

    tok_emb, pos_emb, blocks.{i}.norm_attn, blocks.{i}.attn.qkv, blocks.{i}.attn.proj,
    blocks.{i}.norm_mlp, blocks.{i}.mlp.fc, blocks.{i}.mlp.proj, norm_f, lm_head

`GPT.forward(idx)` returns logits; `lm_loss(logits, targets)` (or `GPT.loss`) gives the
next-token cross-entropy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import (
    check_bool,
    check_choice,
    check_positive_float,
    check_positive_int,
    seeded,
)

BYTE_VOCAB_SIZE = 256  # one token per byte value
ATTENTION_KINDS = ("sdpa", "eager")
INIT_STD = 0.02  # GPT-2 initialisation of linear and embedding weights
DEFAULT_NORM_EPS = 1e-5
DEFAULT_EXAMPLE_BATCH_SIZE = 2

__all__ = [
    "ATTENTION_KINDS",
    "BYTE_VOCAB_SIZE",
    "GPT",
    "GPTConfig",
    "GPT_SIZES",
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "RMSNorm",
    "eager_causal_attention",
    "gpt_factory",
    "lm_loss",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape and options of a `GPT`. Frozen; invalid values raise ValueError naming the field.

    vocab_size: number of token ids (256 for byte-level text).
    block_size: the longest sequence the model accepts (size of the position embedding).
    n_layer, n_head, d_model: depth, heads per attention, residual width (d_model % n_head == 0).
    mlp_ratio: the MLP's hidden width is mlp_ratio * d_model.
    attention: "sdpa" (F.scaled_dot_product_attention) or "eager" (explicit softmax(QKᵀ·s + M)·V).
    bias: whether the linears carry a bias.
    norm_eps: epsilon of every RMSNorm.
    """

    vocab_size: int = BYTE_VOCAB_SIZE
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    mlp_ratio: int = 4
    attention: str = "sdpa"
    bias: bool = False
    norm_eps: float = DEFAULT_NORM_EPS

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "mlp_ratio"):
            check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                "d_model must be a multiple of n_head"
            )
        check_choice("attention", self.attention, ATTENTION_KINDS)
        check_bool("bias", self.bias)
        check_positive_float("norm_eps", self.norm_eps)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head

    @property
    def d_hidden(self) -> int:
        """Hidden width of the MLP."""
        return self.mlp_ratio * self.d_model


GPT_SIZES: Mapping[str, GPTConfig] = MappingProxyType(
    {
        "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, d_model=64),
        "small": GPTConfig(block_size=128, n_layer=4, n_head=4, d_model=256),
        "medium": GPTConfig(block_size=256, n_layer=6, n_head=6, d_model=384),
    }
)
"""Preset configurations by name (read-only)."""


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-channel gain, computed in float32."""

    def __init__(self, dim: int, eps: float = DEFAULT_NORM_EPS) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_float("eps", eps)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection and an output projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.attention = config.attention
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        # (B, T, C) -> (B, H, T, hd)
        q, k, v = (t.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = eager_causal_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


def eager_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(Q Kᵀ · 1/sqrt(head_dim) + M) · V with M = -inf above the diagonal, spelled out
    op by op (the pattern the attention rewrite matches). q, k, v: (..., T, head_dim)."""
    seq, head_dim = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    mask = torch.full((seq, seq), float("-inf"), device=q.device, dtype=q.dtype).triu(diagonal=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class FeedForward(nn.Module):
    """d_model -> mlp_ratio * d_model -> GELU -> d_model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_hidden, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.d_hidden, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm_attn = RMSNorm(config.d_model, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_mlp = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm_attn(x))
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, `n_layer` pre-norm blocks,
    a final RMSNorm and an untied LM head. `forward(idx)` maps (B, T) token ids to (B, T, V) logits.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        config = GPTConfig() if config is None else config
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config={config!r} is not accepted; give a GPTConfig")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit norm gains, and residual
        output projections scaled by 1/sqrt(2 * n_layer). Draws from torch's global generator:
        seed it (or build through `gpt_factory`) for a reproducible model."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: Tensor) -> Tensor:
        """idx: (B, T) integer token ids with T <= block_size. Returns (B, T, vocab_size) logits."""
        if idx.dim() != 2:
            raise ValueError(f"idx has shape {tuple(idx.shape)}; give a (batch, seq) tensor of token ids")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"idx has dtype {idx.dtype}; give integer token ids (torch.long)")
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"idx has sequence length {seq}, longer than block_size={self.config.block_size}"
            )
        positions = torch.arange(seq, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of `forward(idx)` against `targets` (same shape as idx)."""
        return lm_loss(self(idx), targets)

    def num_parameters(self) -> int:
        """Total number of parameters."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Append `max_new_tokens` sampled tokens to `idx` (B, T), conditioning on at most the
        last block_size tokens. Pass a seeded `generator` (on idx's device) for reproducibility."""
        check_positive_int("max_new_tokens", max_new_tokens)
        check_positive_float("temperature", temperature)
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :]
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, next_token.to(idx.dtype)], dim=1)
        return idx


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of (B, T, V) logits against (B, T) target ids, computed in float32."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)}; expected {tuple(logits.shape[:-1])} "
            f"to match logits of shape {tuple(logits.shape)}"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class LanguageModelLoss(nn.Module):
    """A language model and its next-token loss (targets = the input ids, as in the step
    benchmarks) as one module, so that one compiled graph covers the whole training step:
    what the memory planner plans is then all that the step allocates."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return lm_loss(self.model(idx), idx)


def gpt_factory(
    size: str = "tiny",
    *,
    batch_size: int = DEFAULT_EXAMPLE_BATCH_SIZE,
    seed: int = 0,
    attention: str | None = None,
) -> tuple[GPT, tuple[Tensor]]:
    """A seeded GPT of a preset size (see `GPT_SIZES`) and example inputs `(idx,)`, idx being
    (batch_size, block_size) random token ids. The same arguments give the same weights and
    inputs; the caller's global random state is left untouched. `attention` overrides the
    preset's attention kind ("sdpa" or "eager")."""
    check_choice("size", size, list(GPT_SIZES))
    check_positive_int("batch_size", batch_size)
    config = GPT_SIZES[size]
    if attention is not None:
        check_choice("attention", attention, ATTENTION_KINDS)
        config = dataclasses.replace(config, attention=attention)
    model = seeded(seed, lambda: GPT(config))
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (batch_size, config.block_size), generator=generator)
    return model, (idx,)
