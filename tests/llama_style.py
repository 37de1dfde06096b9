"""A small LLaMA-style causal LM written the way Meta's reference code writes it (no KV cache).

RMSNorm by hand, rotary embeddings from precomputed ``cos``/``sin`` buffers sliced ``[:T]`` (or
computed from ``arange(T)`` at run time), grouped-query attention through ``repeat_kv``
(unsqueeze + expand + reshape), a ``full(-inf).triu(1)`` causal mask added to the scores, and a
SwiGLU MLP. ``forward(idx) -> logits (B, T, vocab)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 64
    max_seq_len: int = 48
    rope_theta: float = 10000.0
    rope_tables: bool = True  # False: rotary angles computed from arange(T) in forward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = repeat_kv(k, self.n_heads // self.n_kv)
        v = repeat_kv(v, self.n_heads // self.n_kv)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        out = torch.matmul(probs, v)  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).contiguous().view(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim)
        self.ffn_norm = RMSNorm(cfg.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaStyle(nn.Module):
    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.n_heads
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)
        if cfg.rope_tables:
            cos, sin = self._angles(torch.arange(cfg.max_seq_len))
            self.register_buffer("cos_cached", cos, persistent=False)
            self.register_buffer("sin_cached", sin, persistent=False)

    def _angles(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos(), emb.sin()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        h = self.tok_embeddings(idx)
        if self.cfg.rope_tables:
            cos, sin = self.cos_cached[:t], self.sin_cached[:t]
        else:
            cos, sin = self._angles(torch.arange(t, device=idx.device))
        mask = torch.full((t, t), float("-inf"), device=idx.device).triu(1)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h))
