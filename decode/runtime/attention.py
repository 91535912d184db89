"""The rest of a Llama block's arithmetic, shared by the lean runner, the batched decoder and the draft head:
RMSNorm, RoPE's half rotation and grouped-query attention (the Linear layers are `decode.runtime.kernels`)."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # HF's LlamaRMSNorm op for op (float32 inside, whatever the dtype), so outputs agree with HF's
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """RoPE's rotation: (x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """Attention of q (B, H, T, D) over k, v (B, Hkv, S, D) as two matmuls: query head h reads kv head
    h // (H / Hkv) (HF's repeat_kv pairing), each kv head's group of queries in one matmul; scores and softmax
    in float32 (at least), where `allowed` (bool, broadcastable to (B, Hkv, H / Hkv, T, S)) says which keys a
    query sees (every query must see one). On the CPU it beats torch's flash kernel with a mask where the
    batched decoder attends one bfloat16 token over a padded cache and where a head trains (`ttt_hidden`)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    s = torch.matmul(q.reshape(B, Hkv, G * T, D), k.transpose(-1, -2)).view(B, Hkv, G, T, S)
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * D**-0.5
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype).view(B, Hkv, G * T, S), v).view(B, H, T, D)
