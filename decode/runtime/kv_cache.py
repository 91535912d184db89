"""A preallocated KV cache (gpt-fast style). Rolling back is free: the caller's position is the length.

Entries past the current position are stale and never read (attention only looks at [0, pos + T)),
so rejecting draft tokens costs nothing: the next forward simply writes over them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        shape = (n_layers, n_kv_heads, max_seq_len, head_dim)  # (L, Hkv, S, D)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    def update(self, layer: int, pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (Hkv, T, D) at positions [pos, pos+T); return the valid prefix (Hkv, pos+T, D)."""
        end = pos + k.shape[1]
        self.k[layer, :, pos:end] = k
        self.v[layer, :, pos:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def update_static(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Shape-static variant for CUDA graphs / torch.compile: write at `positions` (T,), return whole buffers."""
        self.k[layer].index_copy_(1, positions, k)
        self.v[layer].index_copy_(1, positions, v)
        return self.k[layer], self.v[layer]
