"""A static, preallocated KV cache: entries live at explicit slots, rollback is a length change.

Slots are cache rows, one per token fed; they are not rope positions (tree nodes at the same
depth share a position but each has its own slot). Every sequence in the batch shares one length.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, kv_heads, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, kv_heads, max_len, head_dim]
        self.length = 0  # slots [0, length) hold valid entries
        self.max_len = max_len
        # Per layer, the first sequence's keys and values [kv_heads, max_len, head_dim]: views made once.
        self.layer_k = list(self.k[:, 0].unbind(0))
        self.layer_v = list(self.v[:, 0].unbind(0))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, head_dim] at slots [length, length+T) of `layer`.

        Returns views of every valid entry of the layer including the new ones: [B, kv_heads, length+T, head_dim].
        `length` itself moves only in `advance`, once all layers are written.
        """
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} slots needed, {self.max_len} allocated")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def write_first(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` for a batch of one, k, v [kv_heads, T, head_dim], returning nothing (the hot path
        of decoding: row-exact attention reads `layer_k` / `layer_v` directly)."""
        end = self.length + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} slots needed, {self.max_len} allocated")
        self.layer_k[layer][:, self.length : end] = k
        self.layer_v[layer][:, self.length : end] = v

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def truncate(self, length: int) -> None:
        """Forget every entry from slot `length` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def keep(self, indices: torch.Tensor | list[int]) -> None:
        """Keep only the entries at `indices` (ascending slots), compacted into slots [0, len(indices)).

        The leading run where indices[i] == i is already in place; only the tail is copied, so
        keeping a prefix plus an accepted tree path costs a copy of the path alone.
        """
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.k.device)  # [n]
        n = idx.numel()
        if n and (int(idx[-1]) >= self.length or bool((idx[1:] <= idx[:-1]).any()) or int(idx[0]) < 0):
            raise ValueError("keep() needs ascending slot indices inside the cache")
        moved = (idx != torch.arange(n, device=idx.device)).nonzero()
        if moved.numel():
            start = int(moved[0])
            src = idx[start:]
            self.k[:, :, :, start:n] = self.k.index_select(3, src)
            self.v[:, :, :, start:n] = self.v.index_select(3, src)
        self.length = n

    def reset(self) -> None:
        self.length = 0
