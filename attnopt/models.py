"""Built-in example models written the way real code writes attention (used by demo and profile).

``NanoGPT`` follows nanoGPT's ``CausalSelfAttention``: fused qkv projection split with
``.split``, heads split with ``view + transpose``, ``q @ k.transpose(-2, -1) * (1/sqrt(d))``,
a ``tril`` buffer mask applied by ``masked_fill(... == 0, -inf)``, ``F.softmax``,
``nn.Dropout``, ``att @ v`` and the ``transpose + contiguous + view`` head merge.

``BertEncoder`` follows Hugging Face's eager ``BertSelfAttention``: separate q, k, v
projections, heads split with ``view + permute``, ``torch.matmul(q, k.transpose(-1, -2)) /
sqrt(d)``, a padding mask turned into an additive ``(B, 1, 1, T)`` mask holding the dtype's
minimum at padded keys, ``nn.functional.softmax``, ``nn.Dropout`` and a post-LayerNorm block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 512
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        t = config.block_size
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, H, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class SDPACausalSelfAttention(CausalSelfAttention):
    """The same block hand-written with SDPA: the peer attnopt is measured against."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        p = self.attn_dropout.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A small nanoGPT-style causal language model: ``forward(idx) -> logits (B, T, vocab)``."""

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True)
class BertConfig:
    max_position: int = 512
    vocab_size: int = 512
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        return x.view(B, T, self.n_head, self.head_dim).permute(0, 2, 1, 3)  # (B, H, T, D)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, H, T, T)
        scores = scores + attention_mask  # (B, 1, 1, T): 0 where kept, dtype minimum at padding
        probs = nn.functional.softmax(scores, dim=-1)
        probs = self.dropout(probs)
        y = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()  # (B, T, H, D)
        return y.view(y.size(0), y.size(1), -1)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attn_out = nn.Linear(config.n_embd, config.n_embd)
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.intermediate = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.output = nn.Linear(4 * config.n_embd, config.n_embd)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.dropout(self.attn_out(self.attention(x, attention_mask))))
        return self.ln_2(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


class BertEncoder(nn.Module):
    """A small BERT-style encoder: ``forward(input_ids, attention_mask) -> hidden states (B, T, C)``.

    ``attention_mask`` is ``(B, T)`` with 1 for tokens and 0 for padding, as tokenizers return it.
    """

    def __init__(self, config: BertConfig | None = None):
        super().__init__()
        self.config = config = config or BertConfig()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embeddings = nn.Embedding(config.max_position, config.n_embd)
        self.ln = nn.LayerNorm(config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.n_layer))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        _, t = input_ids.size()
        if t > self.config.max_position:
            raise ValueError(f"sequence length {t} exceeds max_position {self.config.max_position}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.ln(self.word_embeddings(input_ids) + self.position_embeddings(pos)))
        dtype = x.dtype
        extended = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min  # (B, 1, 1, T)
        for layer in self.layers:
            x = layer(x, extended)
        return x
