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


class RotaryTable:
    """cos and sin of ``offset x inv_freq`` for any offset >= 0, without trigonometry per step.

    An offset is split as ``high x 1024 + low`` and the two angles are added with the sum
    formulas, from a fixed table of 1,024 low rows and a table of high rows that grows with the
    largest offset seen (O(sqrt) of the stream, a few KiB at 32k tokens). Both tables are formed
    in float64, so large offsets keep the phase of the fast pairs. One table serves every layer.
    """

    LOW = 1024

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.double()
        self.low = self._cos_sin(torch.arange(self.LOW, dtype=torch.float64, device=inv_freq.device))
        self.high = self._cos_sin(torch.zeros(1, dtype=torch.float64, device=inv_freq.device))

    def _cos_sin(self, angles_of: torch.Tensor) -> torch.Tensor:
        angles = angles_of[:, None] * self.inv_freq  # (n, d/2)
        return torch.stack([angles.cos(), angles.sin()]).float()  # (2, n, d/2)

    def __call__(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """offsets (...) long >= 0 -> (cos, sin), each (..., d/2)."""
        high, low = offsets.div(self.LOW, rounding_mode="floor"), offsets.remainder(self.LOW)
        rows = int(high.max()) + 1
        if rows > self.high.shape[1]:
            grown = max(rows, 2 * self.high.shape[1])
            steps = torch.arange(grown, dtype=torch.float64, device=self.inv_freq.device) * self.LOW
            self.high = self._cos_sin(steps)
        cos_low, sin_low = self.low[0][low], self.low[1][low]
        cos_high, sin_high = self.high[0][high], self.high[1][high]
        return cos_low * cos_high - sin_low * sin_high, sin_low * cos_high + cos_low * sin_high


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE vectors by the angles whose cos and sin are given: ``R(angle) x``.

    x (..., d); cos/sin (..., d/2) broadcastable to x's leading dims. Uses transformers'
    pairing (dimension i with i + d/2); rotating by -a is ``rotate(x, cos, -sin)``.
    """
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def evicted_before(position: torch.Tensor, evicted: torch.Tensor) -> torch.Tensor:
    """How many evicted slots of each row hold an earlier position than each slot.

    position (b, h, L) long, evicted (b, h, L) bool -> (b, h, L) long. One sort per row and a
    binary search per slot, whatever the number evicted (a prefill chunk evicts many).
    """
    gone = position.masked_fill(~evicted, torch.iinfo(position.dtype).max).sort(dim=-1).values
    return torch.searchsorted(gone, position.contiguous())
