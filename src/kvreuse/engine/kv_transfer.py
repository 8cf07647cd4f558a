"""Moves whole KV blocks between the device KV tensor and host memory: the host tier's edge.

The cache decides *which* blocks move (``cache.host_tier``); this module moves their bytes,
one indexed copy per call for all blocks of the batch (never per token or per layer in
Python). The host storage has the device tensor's layout with its own block count::

    device  [layers, 2, kv_heads, num_blocks * block_size, head_dim]   (the runner's)
    host    [layers, 2, kv_heads, num_host_blocks * block_size, head_dim]

On CUDA the host tensor is pinned; copies are issued on the current stream, so the forward
that later writes an evicted device block is ordered after the offload that read it, and
an onboarded block is in place before the forward that reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostKVTransfer:
    """The ``KVMover`` of a host tier of ``num_host_blocks`` blocks below ``device_kv``
    (the runner's KV tensor, which this object reads and writes but never replaces)."""

    def __init__(self, device_kv: torch.Tensor, num_host_blocks: int, block_size: int) -> None:
        layers, two, heads, slots, head_dim = device_kv.shape
        if slots % block_size:
            raise ValueError(f"device KV has {slots} slots, not a multiple of block_size {block_size}")
        self.block_size = block_size
        self.device_kv = device_kv
        pin = device_kv.device.type == "cuda"
        self.host_kv = torch.zeros(  # [layers, 2, kv_heads, host_slots, head_dim]
            layers,
            two,
            heads,
            num_host_blocks * block_size,
            head_dim,
            dtype=device_kv.dtype,
            device="cpu",
            pin_memory=pin,
        )
        self.bytes_moved = 0

    def _blocks(self, kv: torch.Tensor) -> torch.Tensor:
        layers, two, heads, slots, head_dim = kv.shape
        return kv.view(layers, two, heads, slots // self.block_size, self.block_size, head_dim)

    def offload(self, device_block_ids: Sequence[int], host_block_ids: Sequence[int]) -> None:
        """Copy device blocks into host blocks (same order)."""
        dev = torch.tensor(device_block_ids, dtype=torch.long, device=self.device_kv.device)
        host = torch.tensor(host_block_ids, dtype=torch.long)
        picked = self._blocks(self.device_kv).index_select(3, dev)  # [L, 2, H, n, bs, D] on the device
        self._blocks(self.host_kv).index_copy_(3, host, picked.to("cpu", non_blocking=False))
        self.bytes_moved += picked.numel() * picked.element_size()

    def read_host(self, host_block_ids: Sequence[int]) -> torch.Tensor:
        """A CPU copy of host blocks ``[layers, 2, kv_heads, n, block_size, head_dim]`` (for the
        disk and remote stores; the caller may keep it)."""
        host = torch.tensor(host_block_ids, dtype=torch.long)
        return self._blocks(self.host_kv).index_select(3, host)

    def read_device(self, device_block_ids: Sequence[int]) -> torch.Tensor:
        """A CPU copy of device blocks ``[layers, 2, kv_heads, n, block_size, head_dim]``."""
        dev = torch.tensor(device_block_ids, dtype=torch.long, device=self.device_kv.device)
        return self._blocks(self.device_kv).index_select(3, dev).to("cpu")

    def write_device(self, device_block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Write ``kv`` ``[layers, 2, kv_heads, n, block_size, head_dim]`` (any device) into
        device blocks (same order)."""
        dev = torch.tensor(device_block_ids, dtype=torch.long, device=self.device_kv.device)
        self._blocks(self.device_kv).index_copy_(3, dev, kv.to(self.device_kv.device, self.device_kv.dtype))
        self.bytes_moved += kv.numel() * kv.element_size()

    def onboard(self, host_block_ids: Sequence[int], device_block_ids: Sequence[int]) -> None:
        """Copy host blocks into device blocks (same order)."""
        host = torch.tensor(host_block_ids, dtype=torch.long)
        dev = torch.tensor(device_block_ids, dtype=torch.long, device=self.device_kv.device)
        picked = self._blocks(self.host_kv).index_select(3, host)  # [L, 2, H, n, bs, D] on the host
        if self.device_kv.device.type == "cuda":
            picked = picked.pin_memory().to(self.device_kv.device, non_blocking=True)
        self._blocks(self.device_kv).index_copy_(3, dev, picked)
        self.bytes_moved += picked.numel() * picked.element_size()
