"""infinikv's attention function: where a model's attention meets an infinikv cache layer.

Registered with transformers' ``AttentionInterface`` under the name ``"infinikv"``. A forward
pre-hook on each attention module hands it the cache layer of that module (from the ``cache``
keyword the decoder layer passes) and lets the next layer start its fetch, so no state is
planted on model modules. Without an infinikv cache (e.g. a plain ``DynamicCache``) it is
exactly transformers' SDPA attention.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import native
from .cache import GroupedCache, KVCache
from .modules import attention_modules
from .policies import parse_spec
from .sizes import model_device

NAME = "infinikv"
POLICY_CONFIG_KEY = "infinikv_policy"  # a model's own policy, saved in its config.json


def infinikv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_layer: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function: returns (b, q, H, d) as transformers expects."""
    if kv_layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return kv_layer.attend(query, key, value, scaling).transpose(1, 2), None


def _hand_over_cache_layer(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, KVCache | GroupedCache):
        kwargs["kv_layer"] = cache.layers[module.layer_idx]
        cache.before_attention(
            module.layer_idx,
            kwargs["hidden_states"],
            kwargs.get("position_embeddings"),
            kwargs.get("attention_mask"),
            kwargs.get("position_ids"),
        )
    return args, kwargs


def _default_policy_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Swap the empty DynamicCache that ``generate`` made by default for the model's own policy."""
    spec = getattr(model.config, POLICY_CONFIG_KEY, None)
    cache = kwargs.get("cache")
    if spec and type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False):
        if cache.get_seq_length() == 0:
            kwargs["cache"] = parse_spec(spec).make_cache(model)
    return args, kwargs


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Route ``model``'s attention through infinikv so that infinikv caches work in it.

    Idempotent. Works for transformers models whose attention modules carry ``layer_idx``
    and receive the cache as the ``cache`` keyword (Llama, Mistral, Qwen2, OPT, ...). A model
    whose config names a default policy (``config.infinikv_policy``) uses it in ``generate()``
    whenever no cache is passed.
    """
    if model_device(model).type == "cpu":
        native.available()  # build or load the CPU kernels now, not inside the first decode step
    AttentionInterface.register(NAME, infinikv_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    for module in attention_modules(model).values():
        if _hand_over_cache_layer not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_hand_over_cache_layer, with_kwargs=True)
    if _default_policy_cache not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_default_policy_cache, with_kwargs=True)
    if spec := getattr(model.config, POLICY_CONFIG_KEY, None):
        chunk_generate_prefill(model, parse_spec(spec))
    return model


def chunk_generate_prefill(model: torch.nn.Module, policy) -> None:
    """transformers' own ``generate()`` prefills in ``policy``'s chunks (its generation config's
    ``prefill_chunk_size``), so a model built with a bounded cache holds its capacity plus one
    chunk while it reads a long prompt, not the whole prompt."""
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.prefill_chunk_size = policy.prefill_chunk(model, None)
