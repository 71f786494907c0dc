"""Sizes: as people write them (``64MiB``, ``2GB``), a model's K/V shapes from its config, and the
device its weights are on."""

from __future__ import annotations

import re
from typing import Any

import torch

from .errors import InfinikvError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, flag: str = "--kv-memory") -> int:
    """``"64MiB"`` -> 67108864; accepts B, KB/MB/GB (powers of 10) and KiB/MiB/GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise InfinikvError(f"{flag} {text!r} is not a size like 64MiB, 2GiB or 500MB")
    size = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if size <= 0:
        raise InfinikvError(f"{flag} must be positive, got {text!r}")
    return size


def model_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, n_kv, head_dim


def model_dtype(config: Any) -> torch.dtype:
    """The dtype a model's K/V take: the one it was loaded in (``config.dtype``), else fp32."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def bytes_per_token(config: Any) -> int:
    """K and V bytes one token takes in one layer of a model with ``config``, in its dtype."""
    _, n_kv, head_dim = model_shape(config)
    return 2 * n_kv * head_dim * torch.empty((), dtype=model_dtype(config)).element_size()


def sliding_window(config: Any, index: int) -> int | None:
    """The tokens a query of layer ``index`` sees (itself included) when the model bounds that
    layer's attention to a sliding window (Gemma 3's local layers, Mistral), else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and types[index] != "sliding_attention"):
        return None
    return window


def windows(config: Any) -> list[int | None]:
    """``sliding_window`` of every layer."""
    return [sliding_window(config, i) for i in range(config.num_hidden_layers)]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s weights (where its inputs and caches go)."""
    return next(model.parameters()).device
