"""Decoder-layer building blocks in plain PyTorch, for training the drafter networks.

At inference the same weights run on the shape-invariant kernels (``llama.pack_layer`` packs a
layer saved with these names); here they are ordinary modules with gradients. Names and layouts
follow Hugging Face Llama (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, RoPE
rotating dimension i with i + D/2), so a saved drafter loads in engines that expect them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, D] by positions [B, T] (HF convention: halves, not pairs)."""
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    cos, sin = angles.cos().repeat(1, 1, 1, 2), angles.sin().repeat(1, 1, 1, 2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Multi-head attention whose input may be wider than the model (EAGLE-3 reads 2 h).

    qk_norm_eps: Qwen3's RMSNorm of every query and key head before RoPE (``q_norm``, ``k_norm``).
    """

    def __init__(self, in_size: int, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_size, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_size, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_size, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta), persistent=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """(q, k, v) [B, heads, T, D] of x [B, T, in] at positions [B, T], RoPE applied."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        return rope(self.q_norm(q) if hasattr(self, "q_norm") else q, positions, self.inv_freq), *self.keys(x, positions)

    def keys(self, x: torch.Tensor, positions: torch.Tensor):
        """(k, v) [B, kv, T, D] of x [B, T, in] at positions [B, T], RoPE (and the key norm) applied."""
        batch, length, _ = x.shape
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(self.k_norm(k) if hasattr(self, "k_norm") else k, positions, self.inv_freq), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, heads, T, D] over k, v [B, kv, S, D] where mask [T, S] (or [B, 1, T, S]) is True -> [B, T, h]."""
        group = self.heads // self.kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def causal_mask(length: int, device=None) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()  # [T, T]


class DecoderLayer(nn.Module):
    """A pre-norm Llama decoder layer under Hugging Face's names (``self_attn``, ``mlp``,
    ``input_layernorm``, ``post_attention_layernorm``), causal over its input; subclasses add parts."""

    def __init__(self, hidden: int, inner: int, heads: int, kv_heads: int, head_dim: int, theta: float,
                 eps: float = 1e-6, qk_norm: bool = False):
        super().__init__()
        self.self_attn = Attention(hidden, hidden, heads, kv_heads, head_dim, theta, eps if qk_norm else None)
        self.mlp = MLP(hidden, inner)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def block(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] at positions [B, T] -> [B, T, H], each column seeing itself and the ones before."""
        q, k, v = self.self_attn.project(self.input_layernorm(x), positions)
        h = x + self.self_attn.attend(q, k, v, causal_mask(x.shape[1], x.device))
        return h + self.mlp(self.post_attention_layernorm(h))
