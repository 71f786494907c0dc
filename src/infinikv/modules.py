"""What infinikv reads off a transformers model's attention modules: which they are, and the
queries and keys they attend with, computed the way the model computes them (projections,
QK-norm, RoPE through ``kv.rope.rotate``)."""

from __future__ import annotations

from typing import Any

import torch

from .kv.rope import rotate
from .weights import dense_weight


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each attention module of ``model`` by its layer index."""
    return {
        m.layer_idx: m
        for m in model.modules()
        if hasattr(m, "layer_idx") and m.__class__.__name__.endswith("Attention")
    }


def is_rotary(model: torch.nn.Module) -> bool:
    return hasattr(model.base_model, "rotary_emb")


def project(module: torch.nn.Module, x: torch.Tensor, rope: Any) -> tuple[torch.Tensor, ...]:
    """What ``module`` attends with for its input x (b, n, D): queries (b, H, n, d) and keys
    (b, h, n, d) after any QK-norm and RoPE (``rope``: the ``(cos, sin)`` the module got, or None),
    and the queries' mean square per column before the norm (b, H, d)."""
    d = module.head_dim
    q = module.q_proj(x).view(*x.shape[:2], -1, d).transpose(1, 2)
    k = module.k_proj(x).view(*x.shape[:2], -1, d).transpose(1, 2)
    square = q.pow(2).mean(2)
    if getattr(module, "q_norm", None) is not None:
        q, k = module.q_norm(q), module.k_norm(k)
    if rope is not None:
        cos, sin = (t[:, None, :, : d // 2] for t in rope)  # a pair's two columns share one angle
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return q, k, square


def partial_weights(module: torch.nn.Module, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of W_q (and b_q) for the kept ``columns`` (h, c) of each KV head: (h, g, c, D) and
    (h, g, c) or None."""
    n_kv, head_dim = columns.shape[0], module.head_dim
    weight = dense_weight(module.q_proj).view(n_kv, -1, head_dim, module.q_proj.in_features)
    weight = weight.gather(2, columns[:, None, :, None].expand(-1, weight.shape[1], -1, weight.shape[-1]))
    bias = module.q_proj.bias
    if bias is not None:
        bias = bias.detach().view(n_kv, -1, head_dim)
        bias = bias.gather(2, columns[:, None, :].expand(-1, bias.shape[1], -1))
    return weight.contiguous(), bias
