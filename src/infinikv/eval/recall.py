"""Speculation recall: how much of the true attention mass InfiniGen's fetched set captures.

Offline, with the full cache: at each decode step every layer's true attention is computed from
its real query and all its keys, and compared with the sets that speculation from the previous
layer's input would fetch. Methods compared (same alpha and cap):

- ``pairs``: partial query weights over whole rotary pairs (infinikv's method; no full query);
- ``columns``: the full next-layer query computed from the previous layer's input, masked to
  its top columns (the reference code's way for RoPE models; costs the whole W_q product);
- ``oracle``: the true top tokens, as many as ``pairs`` fetched (an upper bound).
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from ..policies import make_policy
from ..policies.infinigen import attention_modules, is_rotary, kept_columns, partial_weights
from ..speculation import partial_query, select_tokens, speculative_scores


def full_query(module: torch.nn.Module, x: torch.Tensor, rope: tuple | None, head_dim: int) -> torch.Tensor:
    """A layer's whole query for input x (1, 1, D), rotated when ``rope`` is given: (1, H, 1, d)."""
    q = module.q_proj(x).view(1, 1, -1, head_dim).transpose(1, 2)
    if rope is None:
        return q
    cos, sin = rope
    first, second = q.chunk(2, dim=-1)
    return q * cos[:, None] + torch.cat([-second, first], -1) * sin[:, None]


@torch.inference_mode()
def speculation_recall(
    model,
    ids: torch.Tensor,
    prep: dict,
    context: int,
    alpha: float,
    partial_ratio: float,
    max_fetch: float,
    dense_layers: int = 2,
    progress: bool = True,
) -> dict:
    """Mean recall and fetched fraction per method and per layer over ``ids[context:]`` decode steps."""
    modules = attention_modules(model)
    config = model.config
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    rotary = is_rotary(model)
    keep = max(1, round(partial_ratio * d))
    first = max(1, dense_layers)
    inputs: dict[int, tuple] = {}

    def capture(module, args, kwargs):
        inputs[module.layer_idx] = (kwargs["hidden_states"], kwargs.get("position_embeddings"))

    cache = make_policy("full").make_cache(model)
    model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    hooks = [m.register_forward_pre_hook(capture, with_kwargs=True) for m in modules.values()]
    methods = ("pairs", "columns", "oracle")
    recall = {m: [[] for _ in modules] for m in methods}
    fetched = {m: [[] for _ in modules] for m in methods}
    try:
        for step in tqdm(range(context, ids.shape[1]), desc="recall", disable=not progress, leave=False):
            model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True)
            for i in range(first, len(modules)):
                module, (x, rope), (x_prev, _) = modules[i], inputs[i], inputs[i - 1]
                rope = rope if rotary else None
                keys = cache.layers[i].keys[:, :, : cache.layers[i].used]  # (1, h, n + 1, d), current token last
                n = keys.shape[2] - 1
                cap = max(1, math.ceil(max_fetch * n))
                q = full_query(module, x, rope, d).view(1, n_kv, -1, d)  # (1, h, g, d)
                truth = (torch.einsum("bhgd,bhnd->bhgn", q, keys) * module.scaling).softmax(-1)
                truth = truth.mean(2)  # (1, h, n + 1): the group's mean attention per KV head
                # pairs: partial weights, no full query
                cols = kept_columns(prep, i, rotary, partial_ratio, d)
                weight, bias = partial_weights(module, cols)
                sel_cos, sel_sin = (rope[0][:, :, cols], rope[1][:, :, cols]) if rotary else (None, None)
                pq = partial_query(x_prev, weight, bias, sel_cos, sel_sin)
                partial_keys = keys[:, :, :n].gather(-1, cols[None, :, None, :].expand(1, -1, n, -1))
                rows, mask = select_tokens(
                    speculative_scores(pq, partial_keys, module.scaling)[:, :, :, -1], alpha, cap
                )
                chosen = {"pairs": (rows, mask)}
                # columns: the full query from the previous layer's input, top columns only
                top = torch.tensor(prep["column_ranking"][i])[:, :keep]
                q_prev = full_query(module, x_prev, rope, d).view(1, n_kv, -1, 1, d)
                q_cols = q_prev.gather(-1, top[None, :, None, None, :].expand(1, -1, q_prev.shape[2], 1, -1))
                k_cols = keys[:, :, :n].gather(-1, top[None, :, None, :].expand(1, -1, n, -1))
                scores = torch.einsum("bhgqc,bhnc->bhgqn", q_cols, k_cols)[:, :, :, -1] * module.scaling
                chosen["columns"] = select_tokens(scores, alpha, cap)
                count = int(mask.sum(-1).max())
                oracle = truth[..., :n].topk(count, -1).indices.sort(-1).values
                chosen["oracle"] = (oracle, torch.ones_like(oracle, dtype=torch.bool))
                for name, (r, m) in chosen.items():
                    mass = (truth[..., :n].gather(-1, r) * m).sum(-1) + truth[..., n]
                    recall[name][i].append(float(mass.mean()))
                    fetched[name][i].append(float(m.sum(-1).float().mean()) / n)
    finally:
        for hook in hooks:
            hook.remove()

    def mean(values):
        return sum(values) / len(values) if values else None

    return {
        "context": context,
        "steps": ids.shape[1] - context,
        "alpha": alpha,
        "partial_ratio": partial_ratio,
        "max_fetch": max_fetch,
        "methods": {
            name: {
                "recall": mean([v for layer in recall[name] for v in layer]),
                "fetched_fraction": mean([v for layer in fetched[name] for v in layer]),
                "recall_per_layer": [round(mean(layer), 4) if layer else None for layer in recall[name]],
            }
            for name in methods
        },
    }
