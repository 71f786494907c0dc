"""Attention recall: how much of the true attention a policy's choice of tokens captures.

At each decode step (teacher-forced on real text) and in each layer, the true attention of the
step's query is computed over every token with the full cache, and two shares of its mass are
reported: the share on the tokens the policy attends to (its kept slots, or the rows a two-tier
policy fetched, plus the current token), and the share the *oracle* gets with the same number
of tokens (the true top tokens per KV head, an upper bound). Both runs see the same tokens; the
truth uses the full model's own query, so the recall measures the policy's choice, not its drift.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..core import Batch
from ..modules import attention_modules, project
from ..policies import Policy, reference


@torch.inference_mode()
def attention_recall(model, ids: torch.Tensor, policy: Policy, context: int, progress: bool = True) -> dict:
    """Mean recall and oracle recall per layer over the decode steps ``ids[context:]`` (1, n)."""
    modules = attention_modules(model)
    truth, ours = Batch(model, reference()), Batch(model, policy)
    captured: dict[int, tuple] = {}
    chosen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    capturing = [False]

    def capture(module, args, kwargs):
        if capturing[0]:
            captured[module.layer_idx] = (kwargs["hidden_states"], kwargs.get("position_embeddings"))

    for index, layer in enumerate(ours.cache.layers):
        layer.observer = lambda query, scaling, positions, mask, i=index: chosen.__setitem__(i, (positions, mask))
    ids = ids.to(truth.device)
    truth.extend(ids[:, :context])
    ours.extend(ids[:, :context])
    hooks = [m.register_forward_pre_hook(capture, with_kwargs=True) for m in modules.values()]
    n_layers = len(modules)
    recall, oracle, share = ([[] for _ in range(n_layers)] for _ in range(3))
    try:
        for step in tqdm(range(context, ids.shape[1]), desc=f"recall {policy.label()}", disable=not progress):
            capturing[0] = True
            truth.step(ids[:, step])
            capturing[0] = False
            ours.step(ids[:, step])
            for i, module in modules.items():
                slots = truth.cache.layers[i].slots
                keys = slots.keys[:, :, : slots.n]  # every token, the current one last, in order
                n_kv, n = keys.shape[1], keys.shape[2]
                x, rope = captured[i]
                q = project(module, x, rope)[0].view(1, n_kv, -1, keys.shape[-1])  # after QK-norm and RoPE
                probs = (torch.einsum("bhgd,bhnd->bhgn", q, keys) * module.scaling).softmax(-1).mean(2)  # (1, h, n)
                positions, mask = chosen[i]
                got = (probs.gather(-1, positions.clamp(max=n - 1)) * mask).sum(-1)  # (1, h)
                count = mask.sum(-1)  # tokens attended per KV head
                top = probs.topk(int(count.max()), dim=-1).values
                best = (top * (torch.arange(top.shape[-1], device=top.device) < count[..., None])).sum(-1)
                recall[i].append(float(got.mean()))
                oracle[i].append(float(best.mean()))
                share[i].append(float(count.float().mean()) / n)
    finally:
        for hook in hooks:
            hook.remove()
        for layer in ours.cache.layers:
            layer.observer = None

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return {
        **policy.describe(),
        "context": context,
        "steps": ids.shape[1] - context,
        "recall": mean([mean(layer) for layer in recall]),
        "oracle_recall": mean([mean(layer) for layer in oracle]),
        "attended_fraction": mean([mean(layer) for layer in share]),
        "recall_per_layer": [round(mean(layer), 4) for layer in recall],
        "oracle_recall_per_layer": [round(mean(layer), 4) for layer in oracle],
    }
