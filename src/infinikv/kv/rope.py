"""Re-positioning RoPE keys inside a bounded cache (StreamingLLM's "positions within the cache").

A kept key was rotated at its original position p; past the trained context the distance from a
query to the oldest kept keys leaves the range the model learned. Renumbered by rank, a query
sits right after the kept tokens and each kept key at its rank among them, so the distance from
the query at position t to a kept key at p becomes ``t - p - after``, where ``after`` counts the
evicted tokens newer than that key. RoPE logits depend only on distances, and rotations compose
(R(a) R(b) = R(a + b)), so the query keeps its own position and each kept key is rotated forward
by one step whenever a newer token is evicted: an eviction costs one fixed rotation of the keys
older than the victim, never a recomputation, never a per-step rotation of every key by its own
angle.
"""

from __future__ import annotations

import torch


def rotary_inv_freq(model: torch.nn.Module, layer: int = 0) -> torch.Tensor | None:
    """The RoPE frequencies ``(d/2,)`` of ``model``'s layer ``layer``, or None when it has no
    full-width RoPE. A model with a RoPE per layer type (Gemma 3: local and global bases) keeps
    them as ``{type}_inv_freq`` on its rotary module."""
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    types = getattr(config, "layer_types", None)
    for module in model.modules():
        if not module.__class__.__name__.endswith("RotaryEmbedding"):
            continue
        inv_freq = getattr(module, "inv_freq", None)
        if inv_freq is None and types is not None:
            inv_freq = getattr(module, f"{types[layer]}_inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            return inv_freq if 2 * inv_freq.numel() == head_dim else None
    return None


class RotaryTable:
    """cos and sin of ``offset x inv_freq`` for any offset >= 0, without trigonometry per step.

    An offset is split as ``high x 1024 + low`` and the two angles are added with the sum
    formulas, from a fixed table of 1,024 low rows and a table of high rows that grows with the
    largest offset seen (one row per 1,024 positions: 32 rows at 32k tokens). Both tables are formed
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


class Renumbering:
    """Rank positions for the kept keys of one layer's slots (see the module docstring).

    Keeps a per-slot count ``after`` of the evicted tokens newer than each kept key, in every row
    from the start; a row's keys are actually rotated once it has seen more than ``threshold``
    tokens (0: from the first eviction; the trained context: only past it). The row that crosses
    the threshold is caught up once, by a table lookup per key.
    """

    STATE = "after"

    def __init__(self, inv_freq: torch.Tensor, threshold: int) -> None:
        self.table = RotaryTable(inv_freq)
        self.threshold = threshold
        step = inv_freq.double()
        self.cos1, self.sin1 = step.cos().float(), step.sin().float()  # one position step

    def catch_up(self, keys: torch.Tensor, after: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor) -> None:
        """Rotate the kept keys of ``rows`` (b,) bool forward by their ``after`` (b, h, S), in place."""
        moved = (after * (valid & rows[:, None, None])).long()
        cos, sin = self.table(moved)
        keys.copy_(rotate(keys, cos.to(keys.device), sin.to(keys.device)))

    def evict(
        self,
        keys: torch.Tensor,
        after: torch.Tensor,
        position: torch.Tensor,
        valid: torch.Tensor,
        victims: torch.Tensor,
        take: torch.Tensor | None,
        ranked: torch.Tensor | bool,
    ) -> None:
        """Victims (b, h, k) are about to go: every kept key older than a victim moves one step
        forward per such victim, in the rows that are ``ranked`` ((b,) bool, or one bool for all).

        keys (b, h, L, d), after/position/valid (b, h, L), all updated in place.
        """
        newer = position.gather(2, victims)  # (b, h, k)
        if take is not None:
            newer = newer.masked_fill(~take, -1)
        if victims.shape[-1] == 1:
            older = valid & (position < newer)
            after += older
            if ranked is False:
                return
            if ranked is not True:
                older &= ranked[:, None, None]
            cos, sin = self.cos1.to(keys.device), self.sin1.to(keys.device)
            keys.copy_(torch.where(older[..., None], rotate(keys, cos, sin), keys))
            return
        count = ((position[..., None] < newer[:, :, None, :]).sum(-1) * valid).to(after.dtype)
        after += count
        if ranked is False:
            return
        if ranked is not True:
            count = count * ranked[:, None, None]
        cos, sin = self.table(count.long())
        keys.copy_(rotate(keys, cos.to(keys.device), sin.to(keys.device)))
