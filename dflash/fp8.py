"""fp8 storage of hidden states: e4m3 values with one bf16 scale per block of channels.

A state row x [H] (one token, one layer) is cut into G = ceil(H / block) blocks of `block` channels
(the last one zero-padded); each block is stored as e4m3 bytes q = x / s with s = max|x| / 448
rounded to bf16, so that x ≈ q · s. Quantisation runs where the states are computed (the GPU during
extraction), dequantisation inside the training step, in front of `fc`: the cache, the loader's pinned
buffers and the host-to-device copies all carry ~half the bytes of bf16.

A block of zeros (padding) gets s = 0 and q = 0, so it dequantises to exactly 0.

Also the one place that views stored bits as tensors (`to_bits`, `bf16_from_bits`): zarr has no bf16 or
fp8 dtype, so the cache holds their bits as uint16 / uint8, whichever the storage.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dflash.manifest import num_groups

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_DTYPE = torch.bfloat16  # exact for the quantiser, which divides by the rounded scale


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (any float dtype, any device) -> (q [..., H] uint8: e4m3 bits, scale [..., G] bf16)."""
    H = x.shape[-1]
    G = num_groups(H, block)
    x = x.float()
    xb = (F.pad(x, (0, G * block - H)) if G * block > H else x).unflatten(-1, (G, block))  # [..., G, block]
    scale = (xb.abs().amax(-1) / E4M3_MAX).to(SCALE_DTYPE)  # [..., G]
    s = scale.float()
    # divide by the stored (rounded) scale, so q · scale reproduces x as well as e4m3 allows; a rounded-down
    # scale may push the block's largest value a hair past 448: clamp, never overflow to NaN
    q = torch.where(s[..., None] > 0, xb / s[..., None], 0.0).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.to(torch.float8_e4m3fn).flatten(-2)[..., :H]
    return q.view(torch.uint8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """q [..., H] (e4m3, as float8_e4m3fn or its uint8 bits), scale [..., G] -> states [..., H] in `dtype`.
    Elementwise with fixed shapes: inside a compiled step it fuses into the copy that feeds `fc`."""
    H = q.shape[-1]
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    s = scale.float()[..., None].expand(*scale.shape, block).flatten(-2)[..., :H]  # [..., H]
    return (q.float() * s).to(dtype)


def to_bits(t: torch.Tensor) -> np.ndarray:
    """A host tensor's storage bits as numpy (what the cache's chunks hold): bf16 -> uint16, fp8 -> uint8."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def bf16_from_bits(a: np.ndarray) -> torch.Tensor:
    """uint16 bits (as the cache stores bf16) -> a bf16 tensor sharing their memory."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
