"""InfiniGen's speculation as pure tensor functions (shapes in the paper's letters: b batch,
h KV heads, g query heads per KV head, n tokens, d head dim, D model dim, c kept columns).

The paper skews W_q and W_k so that a few columns carry most of q.k. With RoPE a rotation that
mixes dimensions does not commute with the position rotation, so whole *rotary pairs* are kept
instead: RoPE rotates dims ``j`` and ``j + d/2`` together, so a partial dot product over whole
pairs is exact for those pairs whatever the positions. Without RoPE (OPT style) the best single
columns are kept, unskewed.
"""

from __future__ import annotations

import math
from functools import cached_property

import torch
import torch.nn.functional as F

from .rope import rotate


def pair_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """How much each rotary pair carries of q.k, per KV head.

    q (n, H, d) and k (n, h, d), post-RoPE. Returns (h, d/2): the mean pair norm of the group's
    queries (summed over its g heads) times the mean pair norm of the keys.
    """
    half = q.shape[-1] // 2
    q_norm = (q[..., :half] ** 2 + q[..., half:] ** 2).sqrt().mean(0)  # (H, d/2)
    k_norm = (k[..., :half] ** 2 + k[..., half:] ** 2).sqrt().mean(0)  # (h, d/2)
    h = k.shape[1]
    return q_norm.view(h, -1, half).sum(1) * k_norm


def column_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The reference code's per-column score, summed over a KV head's group: mean |q| + |k|.

    q (n, H, d), k (n, h, d) -> (h, d).
    """
    h = k.shape[1]
    return q.abs().mean(0).view(h, -1, q.shape[-1]).sum(1) + k.abs().mean(0)


def pairs_to_columns(pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotary pairs (h, r) -> the 2r columns they occupy (h, 2r), first halves then second."""
    return torch.cat([pairs, pairs + head_dim // 2], dim=-1)


def partial_query(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The kept columns of each query head, from the partial query weight.

    x (b, q, D) the attention input; weight (h, g, c, D) the kept rows of W_q; bias (h, g, c) or
    None; cos/sin (b, q, h, c) at the kept columns (RoPE models, columns laid out as whole pairs
    [first halves | second halves]) or None; ``norm`` the arguments of ``normalize_partial``
    after pq for a QK-norm model, or None. Returns (b, h, g, q, c).
    """
    b, q, _ = x.shape
    h, g, c, width = weight.shape
    pq = F.linear(x, weight.view(h * g * c, width)).view(b, q, h, g, c).permute(0, 2, 3, 1, 4)  # one GEMV
    if bias is not None:
        pq = pq + bias[None, :, :, None, :]
    if norm is not None:
        pq = normalize_partial(pq, *norm)
    if cos is None:
        return pq
    half = cos.shape[-1] // 2  # a pair's two columns share one angle
    cos, sin = (t[..., :half].permute(0, 2, 1, 3)[:, :, None] for t in (cos, sin))
    return rotate(pq, cos, sin)


def normalize_partial(pq: torch.Tensor, gain: torch.Tensor, ratio: torch.Tensor, eps: float) -> torch.Tensor:
    """The partial query of a model that RMS-normalizes each query head (QK-norm, Gemma 3).

    The norm divides a head by the RMS of all its d columns, which the kept c columns do not
    give; it is estimated as their own mean square times ``ratio`` (h, g), the calibrated ratio
    of the full to the kept mean square. pq (b, h, g, q, c) before RoPE; gain (h, c) the norm's
    per-column scale at the kept columns. Returns (b, h, g, q, c).
    """
    square = pq.pow(2).mean(-1, keepdim=True) * ratio[None, :, :, None, None]
    return pq * torch.rsqrt(square + eps) * gain[None, :, None, None, :]


def speculative_scores(pq: torch.Tensor, partial_keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Approximate attention logits: pq (b, h, g, q, c) x partial keys (b, h, n, c) -> (b, h, g, q, n)."""
    b, h, g, q, c = pq.shape
    scores = (pq.reshape(b, h, g * q, c) * scaling) @ partial_keys.transpose(-1, -2)  # one batched GEMM
    return scores.view(b, h, g, q, -1)


def select_tokens(
    scores: torch.Tensor, alpha: float, max_fetch: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens to fetch per KV head, from speculative logits of the newest query.

    scores (b, h, g, n), -inf where a token must not be fetched. A query head wants the tokens
    whose logit is above its max - alpha (softmax weight >= e^-alpha of the largest); a
    sequence fetches the mean of that count over its heads, capped at ``max_fetch`` (an int, or
    one per sequence (b,)); each KV
    head then takes its top tokens by the largest logit any of its g query heads gives them.
    Returns ``(rows, fetch)``, both (b, h, k) with k the largest count in the batch, sorted by
    slot: ``fetch`` is False where a sequence needs fewer than k tokens. Reading k is a host sync
    (the paper's rule; ``select_by_mass`` is the one that makes none).
    """
    n = scores.shape[-1]
    wanted = (scores > scores.amax(-1, keepdim=True) - alpha) & (scores > -math.inf)
    cap = torch.as_tensor(max_fetch, device=scores.device).clamp(max=n)
    counts = torch.minimum(wanted.sum(-1).float().mean((1, 2)).ceil().long(), cap).clamp(min=1)  # (b,)
    combined = scores.amax(2)
    top = combined.topk(int(counts.max()), dim=-1)
    fetch = (torch.arange(top.indices.shape[-1], device=scores.device) < counts[:, None, None]) & (
        top.values > -math.inf
    )
    rows, order = top.indices.sort(-1)
    return rows, fetch.gather(-1, order)


def select_by_mass(
    scores: torch.Tensor,
    mass: float,
    cap: list[int],
    resident: torch.Tensor | tuple[int, int] | None = None,
    masked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fewest tokens per KV head whose speculated attention mass reaches ``mass``.

    scores (b, h, g, n) approximate logits of the newest query, -inf where a token must not be
    fetched (``masked`` False: none is); the group's softmax weights are averaged over its g query
    heads (what the KV head serves). ``cap`` (one int per sequence, known on the host) caps its
    count; ``mass`` >= 1 takes the cap. ``resident`` marks tokens always taken (they come first;
    their mass counts): (b, h, n), (n,) for every row, or ``(first, recent)``: the first and the
    last slots of every row (slots in token order). Returns ``(rows, fetch)``, both (b, h, k), k
    the largest cap in the batch (known on the host: the copy between tiers has a fixed size and no
    step waits for the device to size it); ``fetch`` is False past a head's own count and for
    unfetchable tokens, or None when every row counts. A token whose weight rounds to 0 still
    counts. The rows come in slot order, except where every row takes its whole cap (``mass``
    >= 1, one cap): that set comes in no order, since attention does not depend on it and
    sorting it cost more than choosing it.
    """
    probs, rank, fetchable = mass_ranking(scores, resident, masked, clone=mass < 1)
    k = min(max(cap), probs.shape[-1])
    if mass >= 1 and min(cap) >= k:  # every row takes its top k: the set, in no order (no sort at all)
        rows = rank.topk(k, dim=-1, sorted=False).indices
        return rows, None if fetchable is None else fetchable.gather(-1, rows)
    top = RankedByMass(probs, rank, fetchable, cap)
    rows, order = top.indices.sort(-1)
    return rows, top.take(mass).gather(-1, order)


def mass_ranking(
    scores: torch.Tensor,
    resident: torch.Tensor | tuple[int, int] | None = None,
    masked: bool = True,
    clone: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the mass rule ranks, from ``scores`` (b, h, g, n) and ``resident`` as
    ``select_by_mass`` takes them: the group's mean softmax weights ``probs`` (b, h, n), the
    ``rank`` (residents above any weight) and which tokens are ``fetchable`` (None unless
    ``masked``). ``clone`` False lets a tuple ``resident`` raise ``probs`` in place, for a caller
    that reads only the rank after."""
    probs = scores.softmax(-1).mean(2)  # (b, h, n)
    fetchable = None
    if masked:
        probs = probs.nan_to_num(0.0)  # a row with nothing to fetch is 0
        fetchable = scores.amax(2) > -math.inf  # (b, h, n)
    if isinstance(resident, tuple):  # residents above any weight: first (two slices, in place)
        first, recent = resident
        rank = probs.clone() if clone else probs
        rank[..., :first] += 2
        rank[..., max(first, rank.shape[-1] - recent) :] += 2  # each resident once
    else:
        rank = probs if resident is None else probs + 2 * resident
    return probs, rank, fetchable


class RankedByMass:
    """Each head's top tokens by rank, best first, and what a speculated mass takes of them: one
    top-k serves every mass (calibration measures a dozen on the same scores)."""

    def __init__(self, probs: torch.Tensor, rank: torch.Tensor, fetchable: torch.Tensor | None, cap: list[int]):
        """``mass_ranking``'s outputs (b, h, n) and ``cap``, one int per sequence."""
        k = min(max(cap), probs.shape[-1])
        self.probs, self.indices = probs, rank.topk(k, dim=-1).indices  # (b, h, k)
        self.cap = torch.tensor(cap, device=probs.device)[:, None].clamp(max=probs.shape[-1])  # (b, 1)
        self.fetchable = None if fetchable is None else fetchable.gather(-1, self.indices)

    @cached_property
    def before(self) -> torch.Tensor:
        """(b, h, k): the mass of the tokens ranked above each; only a mass below 1 reads it."""
        weights = self.probs.gather(-1, self.indices)
        return weights.cumsum(-1) - weights

    def take(self, mass: float) -> torch.Tensor:
        """(b, h, k) in rank order: True for the tokens ``mass`` takes, the fewest whose mass
        reaches it within the cap (``mass`` >= 1: the cap), fetchable ones only."""
        counts = self.cap if mass >= 1 else torch.minimum((self.before < mass).sum(-1), self.cap).clamp(min=1)
        fetch = torch.arange(self.indices.shape[-1], device=self.cap.device) < counts[..., None]
        return fetch if self.fetchable is None else fetch & self.fetchable
