"""A timm-style ViT attention block (fused qkv, ``unbind``, scale on q) optimized with attnopt.

    python examples/vit_block.py
"""

from __future__ import annotations

import torch
import torch.nn as nn

import attnopt


class Attention(nn.Module):
    """``timm.models.vision_transformer.Attention`` as written (non-fused path)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, D)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)  # (B, H, N, N)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = attn @ v  # (B, H, N, D)
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        return self.proj_drop(x)


def main() -> None:
    torch.manual_seed(0)
    block = Attention(dim=384, num_heads=6, qkv_bias=True, attn_drop=0.1).eval()
    x = torch.randn(2, 197, 384)  # 14 x 14 patches + class token, ViT-S width

    opt = attnopt.optimize(block)
    with torch.no_grad():
        expected, got = block(x), opt(x)
    print(f"max abs difference: {(expected - got).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected)
    report = attnopt.explain(opt)
    print(report)
    if report.rewritten != 1:
        raise SystemExit("the ViT attention was not rewritten; see the report above")


if __name__ == "__main__":
    main()
