"""A small GPT-style language model (torch), used by `memfit demo`, `memfit profile`
and the tests. GPT-2's architecture: learned positions, pre-LayerNorm blocks, GELU
MLP, dropout, tied input/output embeddings. Its parameter count and activation
memory follow the formulas in memfit.memory exactly, so estimates can be checked
against measurement.

    >>> from memfit.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=256, max_pos=128))
    >>> sum(p.numel() for p in model.parameters())
    124672
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    vocab: int = 256
    max_pos: int = 256
    d_ff: int | None = None  # default 4 * d_model
    dropout: float = 0.0
    attention: str = "sdpa"  # "sdpa" (fused, no s^2 scores kept) or "eager"

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, cfg.ff)
        self.mlp_proj = nn.Linear(cfg.ff, d)
        self.drop = nn.Dropout(cfg.dropout)

    def attention(self, x):
        b, s, d = x.shape
        h = self.cfg.n_head
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(b, s, h, d // h).transpose(1, 2) for t in (q, k, v))
        if self.cfg.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.cfg.dropout if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = F.dropout(att, self.cfg.dropout, self.training) @ v
        return self.drop(self.c_proj(y.transpose(1, 2).reshape(b, s, d)))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    """GPT-2-style decoder. ``forward(idx, targets=None)`` returns logits, or
    ``(logits, loss)`` when targets are given."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_pos, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        if s > self.cfg.max_pos:
            raise ValueError(f"idx: sequence length {s} exceeds max_pos {self.cfg.max_pos}")
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied embeddings
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
