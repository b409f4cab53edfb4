"""Outputs handed to a model on a GPU, and their gradients back to the host where the rows live.

A copy between pageable host memory and a GPU goes through the driver's staging buffers (on
an H100 host a 4096 x 512 float32 output and its gradient cost ~12 ms a step that way, more
than the embedding work); from page-locked memory it is one DMA. So the fused forwards pool
straight into a pinned buffer (PyTorch's caching host allocator: reused, and not handed out
again before the copy that reads it has finished), the copy to the GPU is queued without
waiting, and the gradient comes back into a pinned buffer. Outputs the general path made in
pageable memory (stores without the fused path: LMDB, SQL, ...) are first copied into a
pinned buffer when large: one memory copy on the host costs less than the driver's staging.
"""

from __future__ import annotations

from typing import Any

import torch

#: pageable outputs at least this large go to the GPU through a pinned copy (smaller ones are
#: cheaper to hand to the driver as they are)
PIN_COPY_BYTES = 1 << 18


def staged(device: torch.device) -> bool:
    """Whether outputs for ``device`` are pooled into pinned host memory."""
    return device.type == "cuda"


def host_empty(shape: tuple[int, ...], pinned: bool) -> torch.Tensor:
    """An uninitialised float32 host tensor, page-locked where ``pinned``."""
    return torch.empty(shape, dtype=torch.float32, pin_memory=pinned)


def to_device(out: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (on the host) in ``device`` and ``dtype``, its gradient back on the host."""
    if out.dtype == dtype and out.device == device:  # (a model on the host: every step)
        return out
    if device.type == "cpu" or out.device == device or torch.compiler.is_compiling():
        return out.to(device, dtype)  # (a compiled graph places its own copies)
    return _ToDevice.apply(out, device, dtype)


class _ToDevice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = out.dtype
        if not staged(device):
            return out.to(device, dtype)
        if not out.is_pinned() and out.numel() * out.element_size() >= PIN_COPY_BYTES:
            out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True).copy_(out)
        # a pinned source is copied without waiting; a pageable one waits for its copy
        return out.to(device, dtype, non_blocking=out.is_pinned())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=staged(grad.device))
        host.copy_(grad)  # waits: the store reads it next
        return host.to(ctx.dtype), None, None
