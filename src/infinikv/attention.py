"""infinikv's attention function: the one place where a ``KVLayer`` meets the queries.

Registered with transformers' ``AttentionInterface`` under the name ``"infinikv"``. A forward
pre-hook on each attention module hands it the cache layer of that module (from the ``cache``
keyword the decoder layer passes), so no state is planted on model modules. Without an
infinikv cache (e.g. a plain ``DynamicCache``) it is exactly transformers' SDPA attention.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .policies import policy_from_spec
from .policies.base import KVCache, KVLayer

NAME = "infinikv"
QUERY_CHUNK = 1024  # queries per block when attention weights are materialised


def grouped(query: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(b, H, q, d) -> (b, h, H/h, q, d): the query heads that share each KV head."""
    b, n_heads, q, d = query.shape
    return query.view(b, n_kv_heads, n_heads // n_kv_heads, q, d)


def weighted_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention that also returns the probability mass each key received.

    query (b, H, q, d), key/value (b, h, L, d), visible (b, h, q, L) or None, bias (b, h, L) or
    None. Returns the output (b, H, q, d); the probabilities summed over the q queries and the
    H/h query heads of each KV head (b, h, L); and those of the last query alone, summed over
    the heads (b, h, L). Queries are processed in blocks so the (q, L) weights of a long
    prefill never exist all at once.
    """
    qg = grouped(query, key.shape[1])
    outputs, mass = [], torch.zeros(key.shape[:3], dtype=torch.float32, device=key.device)
    for start in range(0, qg.shape[3], QUERY_CHUNK):
        block = qg[:, :, :, start : start + QUERY_CHUNK]
        logits = torch.einsum("bhgqd,bhld->bhgql", block, key) * scaling
        if bias is not None:
            logits = logits + bias[:, :, None, None, :]
        if visible is not None:
            logits = logits.masked_fill(~visible[:, :, None, start : start + QUERY_CHUNK], float("-inf"))
        probs = logits.float().softmax(-1)
        mass += probs.sum((2, 3))
        last = probs[:, :, :, -1].sum(2)
        outputs.append(torch.einsum("bhgql,bhld->bhgqd", probs.to(value.dtype), value))
    return torch.cat(outputs, dim=3).flatten(1, 2), mass, last


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """SDPA over per-KV-head masks without repeating K/V; shapes as in ``weighted_attention``."""
    b, n_heads, q, d = query.shape
    n_kv = key.shape[1]
    mask = None
    if visible is not None:
        mask = visible[:, :, None].expand(-1, -1, n_heads // n_kv, -1, -1)
        if bias is not None:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
            mask = mask + bias[:, :, None, None, :]
        mask = mask.reshape(b, n_kv, -1, key.shape[2])
    elif bias is not None:
        mask = bias[:, :, None, :].to(query.dtype)
    qg = grouped(query, n_kv).reshape(b, n_kv, -1, d)
    out = F.scaled_dot_product_attention(qg, key, value, attn_mask=mask, scale=scaling)
    return out.view(b, n_heads, q, d)


def new_token_validity(attention_mask: torch.Tensor | None, q: int, batch: int) -> torch.Tensor | None:
    """Which of the q new tokens are real (not padding), from the mask transformers built.

    Only the last q key columns of that mask are trusted (they are the new tokens whatever was
    evicted); its last query row is a real token under left padding, so it sees exactly the
    real new keys. Returns (b, q) bool, or None when every token is real.
    """
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return None
    row = attention_mask[:, 0, -1, -q:]
    if bool(row.all()):
        return None
    return row.expand(batch, q)


def infinikv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_layer: KVLayer | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function: returns (b, q, H, d) as transformers expects."""
    if kv_layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    started = time.perf_counter()
    kv_layer.admit(new_token_validity(attention_mask, query.shape[2], query.shape[0]))
    query, key = kv_layer.positioned(query, key)
    bias = kv_layer.logit_bias()
    if kv_layer.starts_clean() and bias is None and not kv_layer.observes_attention:
        # a first chunk without padding: plain causal attention, SDPA's fast path
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        kv_layer.commit(key.shape[2])
        kv_layer.clock["attend"] += time.perf_counter() - started
        return out.transpose(1, 2), None
    visible = kv_layer.visibility()
    if kv_layer.observes_attention:
        out, mass, last = weighted_attention(query, key, value, visible, bias, scaling)
        kv_layer.observe(mass, last)
    else:
        out = sdpa(query, key, value, visible, bias, scaling)
    attended = key.shape[2] if visible is None else float(visible[:, :, -1].sum(-1).float().mean())
    kv_layer.commit(attended)
    kv_layer.clock["attend"] += time.perf_counter() - started
    return out.transpose(1, 2), None


def _hand_over_cache_layer(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, KVCache):
        kwargs["kv_layer"] = cache.layers[module.layer_idx]
        cache.before_attention(module.layer_idx, kwargs["hidden_states"], kwargs.get("position_embeddings"))
    return args, kwargs


POLICY_CONFIG_KEY = "infinikv_policy"  # a model's default policy, saved in its config.json


def _default_policy_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Swap the empty DynamicCache that ``generate`` made by default for the model's own policy."""
    spec = getattr(model.config, POLICY_CONFIG_KEY, None)
    cache = kwargs.get("cache")
    if spec and type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False):
        if cache.get_seq_length() == 0:
            kwargs["cache"] = policy_from_spec(spec).make_cache(model)
    return args, kwargs


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Route ``model``'s attention through infinikv so that infinikv caches work in it.

    Idempotent. Works for transformers models whose attention modules carry ``layer_idx``
    and receive the cache as the ``cache`` keyword (Llama, Mistral, Qwen2, OPT, ...). A model
    whose config names a default policy (``config.infinikv_policy``) uses it in ``generate()``
    whenever no cache is passed.
    """
    AttentionInterface.register(NAME, infinikv_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    for module in model.modules():
        if hasattr(module, "layer_idx") and module.__class__.__name__.endswith("Attention"):
            if _hand_over_cache_layer not in module._forward_pre_hooks.values():
                module.register_forward_pre_hook(_hand_over_cache_layer, with_kwargs=True)
    if _default_policy_cache not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_default_policy_cache, with_kwargs=True)
    return model
