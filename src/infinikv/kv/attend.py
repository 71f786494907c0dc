"""Attention over slots as pure tensor functions (b batch, H query heads, h KV heads, g = H/h
query heads per KV head, q queries, L slots, d head dim). K/V are never repeated per query head:
the g query heads of a KV head are folded into its rows of queries."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import native

# Queries per block when attention weights are materialised: a block's weights stay in the CPU's
# caches (measured, 2 threads: a 4,096-token prefill of snapkv 45 s with blocks of 1,024, 28 s with 64).
QUERY_CHUNK = 64
PEAK_BLOCK_BYTES = 4 << 20  # attention weights per block of ``peak_attention``
PEAK_MIN_QUERIES = 16  # its fewest queries per block: each block reads every key once


def grouped(query: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(b, H, q, d) -> (b, h, g, q, d): the query heads that share each KV head."""
    b, n_heads, q, d = query.shape
    return query.view(b, n_kv_heads, n_heads // n_kv_heads, q, d)


def runs_natively(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """A decode step's attention can use infinikv's CPU kernel (``native.decode_attention``)."""
    return (
        native.ready
        and query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == torch.float32
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and query.shape[-1] % 16 == 0
    )


def decode_natively(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    scaling: float,
    want_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per head (query (b, H, 1, d)) through the native kernel: the output (b, H, 1, d)
    and each slot's probability summed over its KV head's query heads (b, h, L) (with ``want_mass``)."""
    out, mass = torch.ops.infinikv.decode_attention(
        query[:, :, 0], key, value, None if visible is None else visible[:, :, 0], bias, scaling, want_mass
    )
    return out[:, :, None], mass


def causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Plain causal attention of a first chunk (nothing stored, no padding): (b, H, q, d)."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)


def masked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """SDPA over per-KV-head masks: query (b, H, q, d), key/value (b, h, L, d), visible
    (b, h or 1, q or 1, L) bool or None (all visible), bias (b, h, L) or None -> (b, H, q, d)."""
    b, n_heads, q, d = query.shape
    if q == 1 and runs_natively(query, key, value):
        return decode_natively(query, key, value, visible, bias, scaling, False)[0]
    n_kv = key.shape[1]
    g = n_heads // n_kv
    if visible is not None and visible.shape[1] == 1 and bias is None:  # one mask for every head
        return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling, enable_gqa=True)
    mask = None
    if visible is not None:
        visible = visible.expand(-1, n_kv, -1, -1)
        mask = visible[:, :, None].expand(-1, -1, g, -1, -1).reshape(b, n_kv, -1, key.shape[2]) if q > 1 else visible
        if bias is not None:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
            mask = mask + bias[:, :, None, :]
    elif bias is not None:
        mask = bias[:, :, None, :].to(query.dtype)
    qg = grouped(query, n_kv).reshape(b, n_kv, g * q, d)
    out = F.scaled_dot_product_attention(qg, key, value, attn_mask=mask, scale=scaling)
    return out.view(b, n_heads, q, d)


def weighted(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    scaling: float,
    causal: bool = False,
    watched: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention that also returns the probability mass each slot received.

    Shapes as in ``masked``. Returns the output (b, H, q, d); the probabilities summed over the q
    queries and the g query heads of each KV head (b, h, L); and those of the newest ``watched``
    queries alone, summed the same way (b, h, L). Queries run in blocks, so the (q, L) weights of a long
    prefill never exist all at once. ``causal`` (a first chunk: the keys are the queries, in
    order; ``visible`` unused) masks each block by its own triangle and skips the keys no query
    of the block sees, instead of a (b, h, q, L) mask: half the work, none of the mask's memory.
    """
    qg = grouped(query, key.shape[1])
    q = qg.shape[3]
    if q == 1 and runs_natively(query, key, value):
        out, mass = decode_natively(query, key, value, visible, bias, scaling, True)
        return out, mass, mass
    if q == 1:  # a decode step: one block, two matrix products, no copies
        logits = torch.matmul(qg[:, :, :, 0], key.transpose(-1, -2)) * scaling  # (b, h, g, L)
        if bias is not None:
            logits = logits + bias[:, :, None, :]
        if visible is not None:
            logits = logits.masked_fill(~visible, float("-inf"))
        probs = logits.softmax(-1, dtype=torch.float32)
        last = probs.sum(2)
        out = torch.matmul(probs if value.dtype == probs.dtype else probs.to(value.dtype), value)  # (b, h, g, d)
        return out.reshape(query.shape), last, last
    b, h, g, _, d = qg.shape
    outputs, mass = [], torch.zeros(key.shape[:3], dtype=torch.float32, device=key.device)
    last = torch.zeros_like(mass)
    for start in range(0, q, QUERY_CHUNK):
        block = qg[:, :, :, start : start + QUERY_CHUNK]
        c = block.shape[3]
        seen = start + c if causal else key.shape[2]  # the keys this block's queries may see
        rows = (block * scaling).reshape(b, h, g * c, d)  # one matrix product per KV head: no einsum copies
        logits = torch.matmul(rows, key[:, :, :seen].transpose(-1, -2)).view(b, h, g, c, seen)
        if bias is not None:
            logits = logits + bias[:, :, None, None, :seen]
        if causal:
            later = torch.ones(c, seen, dtype=torch.bool, device=key.device).triu(start + 1)
            logits = logits.masked_fill_(later, float("-inf"))
        elif visible is not None:
            logits = logits.masked_fill_(~visible[:, :, None, start : start + QUERY_CHUNK], float("-inf"))
        probs = logits.softmax(-1, dtype=torch.float32)
        mass[:, :, :seen] += probs.sum((2, 3))
        first_watched = max(0, q - watched - start)  # of this block's queries
        if first_watched < c:
            last[:, :, :seen] += probs[:, :, :, first_watched:].sum((2, 3))
        out = torch.matmul(probs.to(value.dtype).view(b, h, g * c, seen), value[:, :, :seen])
        outputs.append(out.view(b, h, g, c, d))
    return torch.cat(outputs, dim=3).flatten(1, 2), mass, last


def fuses_beside(query: torch.Tensor) -> bool:
    """``weighted_beside`` runs for ``query``'s device (its fused kernel is the CPU's)."""
    return query.device.type == "cpu"


def weighted_beside(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pooled: int,
    pooled_visible: torch.Tensor | None,
    visible: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: float,
    watched: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weighted`` for a prefill chunk over rows fetched from a pool beside a tier's own slots,
    where only the own slots' probability mass is wanted (what ``recall``'s fast tier observes).

    query (b, H, q, d); key/value (b, h, k + L, d): the ``pooled`` = k fetched rows, then the L own
    slots; pooled_visible (b, h or 1, k) bool or None (all): the same for every query, as every
    fetched row precedes the chunk; visible (b, h or 1, q, L) and bias (b, h, L) or None: the own
    slots'. Returns the output (b, H, q, d) and the own slots' mass (b, h, L), of all queries and of
    the newest ``watched``. The pooled rows go through one fused attention that returns its
    log-sum-exp (torch's CPU kernel: see ``fuses_beside``), and only the (q, L) weights of the own
    slots exist: at a 16k prompt's end the pool is 95% of the keys (measured, 512 queries beside
    12,000 pooled rows: 1.02 s against ``weighted``'s 3.85 s)."""
    if pooled == 0:
        return weighted(query, key, value, visible, bias, scaling, False, watched)
    b, n_heads, q, d = query.shape
    h = key.shape[1]
    g = n_heads // h
    qg = grouped(query, h)
    mask = None
    if pooled_visible is not None:
        hidden = ~pooled_visible[:, :, None]
        mask = torch.zeros(hidden.shape, dtype=query.dtype, device=query.device).masked_fill_(hidden, float("-inf"))
    out_pooled, lse_pooled = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg.reshape(b, h, g * q, d), key[:, :, :pooled], value[:, :, :pooled], attn_mask=mask, scale=scaling
    )
    if pooled_visible is not None:  # a row that sees no pooled key: the kernel says 0, it is -inf
        lse_pooled = lse_pooled.masked_fill(~pooled_visible.any(-1, keepdim=True), float("-inf"))
    out_pooled, lse_pooled = out_pooled.view(b, h, g, q, d), lse_pooled.view(b, h, g, q, 1)
    key, value = key[:, :, pooled:], value[:, :, pooled:]
    outputs, mass = [], torch.zeros(key.shape[:3], dtype=torch.float32, device=key.device)
    last = torch.zeros_like(mass)
    for start in range(0, q, QUERY_CHUNK):  # the own slots' weights, a block of queries at a time
        block = qg[:, :, :, start : start + QUERY_CHUNK]
        c = block.shape[3]
        rows = (block * scaling).reshape(b, h, g * c, d)
        logits = torch.matmul(rows, key.transpose(-1, -2)).view(b, h, g, c, -1).float()
        if bias is not None:
            logits = logits + bias[:, :, None, None, :]
        logits = logits.masked_fill_(~visible[:, :, None, start : start + c], float("-inf"))
        pooled_lse = lse_pooled[:, :, :, start : start + c]
        total = torch.logaddexp(pooled_lse, logits.logsumexp(-1, keepdim=True))
        probs = (logits - total).exp_()
        mass += probs.sum((2, 3))
        first_watched = max(0, q - watched - start)  # of this block's queries
        if first_watched < c:
            last += probs[:, :, :, first_watched:].sum((2, 3))
        out = torch.matmul(probs.to(value.dtype).view(b, h, g * c, -1), value).view(b, h, g, c, d)
        outputs.append(out + out_pooled[:, :, :, start : start + c] * (pooled_lse - total).exp().to(out.dtype))
    return torch.cat(outputs, dim=3).reshape(b, n_heads, q, d), mass, last


def peak_attention(
    query: torch.Tensor, key: torch.Tensor, scaling: float, upto: int, block_bytes: int = PEAK_BLOCK_BYTES
) -> torch.Tensor:
    """The most attention any query pays each of the first ``upto`` keys, under a causal mask.

    ``query`` (b, H, q, d) are the newest q of the L positions of ``key`` (b, h, L, d) (a prefill
    chunk over every token so far). Returns (b, h, upto) float32: the maximum of the softmax
    probabilities over the q queries and each KV head's g query heads, 0 where no query sees a key.
    Queries run in blocks of about ``block_bytes`` of weights (at least ``PEAK_MIN_QUERIES``
    queries): blocks that stay in the CPU's caches and reuse the memory the last one freed ran
    2.7-3.7x faster than blocks of 1,024 queries (2 cores). A maximum is exact whatever the blocks."""
    qg = grouped(query, key.shape[1])
    b, h, g, q, d = qg.shape
    length = key.shape[2]
    rows = max(PEAK_MIN_QUERIES, block_bytes // (b * h * g * length * 4))  # queries per block
    peak = torch.zeros(b, h, upto, dtype=torch.float32, device=key.device)
    for start in range(0, q, rows):
        block = qg[:, :, :, start : start + rows]
        c = block.shape[3]
        first = length - q + start  # the block's first query's position
        seen = first + c  # keys its last query may see
        logits = torch.matmul((block * scaling).reshape(b, h, g * c, d), key[:, :, :seen].transpose(-1, -2))
        logits = logits.view(b, h, g, c, seen)
        later = torch.ones(c, c, dtype=torch.bool, device=key.device).triu(1)  # keys before ``first``: seen by all
        logits[..., first:].masked_fill_(later, float("-inf"))
        probs = logits.softmax(-1, dtype=torch.float32)
        kept = min(upto, seen)
        peak[:, :, :kept] = torch.maximum(peak[:, :, :kept], probs[..., :kept].amax((2, 3)))
    return peak
