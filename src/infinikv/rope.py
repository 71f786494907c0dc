"""Re-positioning RoPE keys inside a bounded cache (StreamingLLM's "positions within the cache").

A kept key was rotated at its original position p; past the trained context those positions
leave the range the model learned. RoPE rotations compose, R(a) R(b) = R(a + b), so a stored
key moves to its rank r among the kept tokens with R(r - p), and a query to the position right
after them the same way, without ever recomputing a key from the hidden states.
"""

from __future__ import annotations

import torch


def rotary_inv_freq(model: torch.nn.Module) -> torch.Tensor | None:
    """The RoPE frequencies ``(d/2,)`` of ``model``, or None when it has no full-width RoPE."""
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if module.__class__.__name__.endswith("RotaryEmbedding") and isinstance(inv_freq, torch.Tensor):
            return inv_freq if 2 * inv_freq.numel() == head_dim else None
    return None


def rotate(x: torch.Tensor, offsets: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE-rotated vectors by ``offsets`` positions: ``R(offset) x``.

    x (..., d); offsets (...) integers broadcastable to ``x.shape[:-1]``; inv_freq (d/2,). Uses
    transformers' pairing (dimension i with i + d/2). Angles are formed in float64 because
    offsets reach tens of thousands, where float32 would lose the phase of the fast pairs.
    """
    angles = offsets[..., None].double() * inv_freq.to(device=offsets.device, dtype=torch.float64)
    angles = torch.cat([angles, angles], dim=-1)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * angles.cos().to(x.dtype) + rotated_half * angles.sin().to(x.dtype)


def evicted_before(position: torch.Tensor, evicted: torch.Tensor) -> torch.Tensor:
    """How many evicted slots of each row hold an earlier position than each slot.

    position (b, h, L) long, evicted (b, h, L) bool -> (b, h, L) long. One sort per row and a
    binary search per slot, whatever the number evicted (a prefill chunk evicts many).
    """
    gone = position.masked_fill(~evicted, torch.iinfo(position.dtype).max).sort(dim=-1).values
    return torch.searchsorted(gone, position.contiguous())
