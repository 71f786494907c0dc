"""``infinigen``: InfiniGen (Lee et al., "InfiniGen: Efficient Generative Inference of Large
Language Models with Dynamic KV Cache Management", OSDI 2024). Every token's K/V stays in the
slow tier; one layer ahead, a cheap rehearsal with the previous layer's attention input, a
partial query weight and a partial key cache guesses which few tokens each KV head will attend
to, and only those are fetched. Nothing is ever dropped, so a token ignored now can be fetched
again later. The first ``dense_layers`` layers and the prefill attend to everything.

For RoPE models the partial columns are whole rotary pairs, chosen per KV head offline
(``infinikv prepare``), so the partial dot product is exact for the kept pairs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..errors import InfinikvError
from ..kv.slots import Slots, StateSpec, expand_to
from ..speculation import (
    column_scores,
    pair_scores,
    pairs_to_columns,
    partial_query,
    select_tokens,
    skew_matrices,
    speculative_scores,
)
from . import register
from .base import Budget, Option, Policy, Rule, Scoring
from .layer import Fetcher, KVCache, KVLayer
from .offload import slow_tier

PREP_FILE = "infinikv-infinigen.json"
DEFAULT_CALIBRATION = "austen:persuasion"


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each attention module of ``model`` by its layer index."""
    return {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")}


def is_rotary(model: torch.nn.Module) -> bool:
    return hasattr(model.base_model, "rotary_emb")


@torch.inference_mode()
def attention_inputs(
    model: torch.nn.Module, ids: torch.Tensor, progress: bool = False
) -> dict[int, tuple[torch.Tensor, Any]]:
    """Each layer's attention input x (1, n, D) and RoPE ``(cos, sin)`` (or None) for ``ids`` (1, n)."""
    from tqdm import tqdm

    captured: dict[int, tuple[torch.Tensor, Any]] = {}
    modules = attention_modules(model)
    bar = tqdm(total=len(modules), desc="calibrating", unit="layer", disable=not progress, leave=False)

    def capture(module, args, kwargs):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs.get("position_embeddings"))
        bar.update(1)

    hooks = [m.register_forward_pre_hook(capture, with_kwargs=True) for m in modules.values()]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    return captured


@torch.inference_mode()
def calibrate(model: torch.nn.Module, ids: torch.Tensor, progress: bool = False) -> dict[str, Any]:
    """Rank each KV head's rotary pairs (and single columns) by how much of q.k they carry.

    Runs ``ids`` (1, n) through the model once and uses every layer's post-RoPE queries and
    keys. Returns ``{"pair_ranking": [layer][kv head][pairs, best first], "column_ranking": ...}``.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    pair_ranking, column_ranking = [], []
    modules = attention_modules(model)
    for index, (x, rope) in sorted(attention_inputs(model, ids, progress).items()):
        module = modules[index]
        q = module.q_proj(x).view(*x.shape[:2], -1, module.head_dim).transpose(1, 2)
        k = module.k_proj(x).view(*x.shape[:2], -1, module.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary_pos_emb(q, k, *rope)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # (n, H, d), (n, h, d)
        pair_ranking.append(pair_scores(q, k).argsort(-1, descending=True).tolist())
        column_ranking.append(column_scores(q, k).argsort(-1, descending=True).tolist())
    return {"pair_ranking": pair_ranking, "column_ranking": column_ranking, "tokens": int(ids.shape[1])}


@torch.inference_mode()
def skew(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Fold a per-head orthogonal skew into W_q and W_k (and biases) of a model without RoPE.

    Each head's queries on ``ids`` (1, n) give A = V from their SVD; W_q <- A^T W_q and
    W_k <- A^T W_k per head, so q.k (and the logits) are unchanged while a few query columns
    carry most of the product. Returns the A of each layer (H, d, d). Refuses RoPE models,
    where a rotation mixing dimensions does not commute with the position rotation.
    """
    if is_rotary(model):
        raise InfinikvError("exact skewing needs a model without RoPE; RoPE models keep whole rotary pairs instead")
    modules = attention_modules(model)
    inputs = attention_inputs(model, ids)
    matrices = []
    for index, module in sorted(modules.items()):
        x = inputs[index][0]
        a = skew_matrices(module.q_proj(x)[0].view(x.shape[1], -1, module.head_dim))  # (H, d, d)
        for proj in (module.q_proj, module.k_proj):
            weight = proj.weight.view(a.shape[0], module.head_dim, -1)
            proj.weight.copy_((a.transpose(-1, -2) @ weight).view_as(proj.weight))
            if proj.bias is not None:
                bias = proj.bias.view(a.shape[0], module.head_dim, 1)
                proj.bias.copy_((a.transpose(-1, -2) @ bias).view_as(proj.bias))
        matrices.append(a)
    return matrices


def prep_path(model: torch.nn.Module) -> Path:
    """Where ``model``'s preparation is saved: next to its weights."""
    folder = Path(model.name_or_path or "")
    if not model.name_or_path or not folder.is_dir():
        raise InfinikvError(f"infinigen's preparation is saved next to the model, but {folder} is not a folder")
    return folder / PREP_FILE


def prepare(
    model: torch.nn.Module, tokenizer, calibration: str = DEFAULT_CALIBRATION, tokens: int = 2048, progress: bool = True
) -> Path:
    """Calibrate on ``tokens`` tokens of a text and save the result next to the model."""
    from ..data import load_text

    path = prep_path(model)
    ids = tokenizer(load_text(calibration, from_chapter_one=True)[: tokens * 8], return_tensors="pt").input_ids
    prep = calibrate(model, ids[:, :tokens].to(next(model.parameters()).device), progress)
    prep["calibration"] = calibration
    path.write_text(json.dumps(prep))
    return path


def kept_columns(prep: dict[str, Any], layer: int, rotary: bool, ratio: float, head_dim: int) -> torch.Tensor:
    """The columns each KV head keeps (h, c): its best rotary pairs (RoPE) or best columns."""
    if rotary:
        pairs = max(1, round(ratio * head_dim / 2))
        return pairs_to_columns(torch.tensor(prep["pair_ranking"][layer])[:, :pairs], head_dim)
    return torch.tensor(prep["column_ranking"][layer])[:, : max(1, round(ratio * head_dim))]


def partial_weights(module: torch.nn.Module, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of W_q (and b_q) for the kept columns: (h, g, c, D) and (h, g, c) or None."""
    n_kv, head_dim = columns.shape[0], module.head_dim
    weight = module.q_proj.weight.detach().view(n_kv, -1, head_dim, module.q_proj.in_features)
    weight = weight.gather(2, columns[:, None, :, None].expand(-1, weight.shape[1], -1, weight.shape[-1]))
    bias = module.q_proj.bias
    if bias is not None:
        bias = bias.detach().view(n_kv, -1, head_dim)
        bias = bias.gather(2, columns[:, None, :].expand(-1, bias.shape[1], -1))
    return weight.contiguous(), bias


class Speculation(Fetcher):
    """One layer ahead, guesses the rows each KV head of this layer will attend to: the previous
    layer's attention input times this layer's partial query weights, against the partial keys
    (the kept columns of every stored key, a per-slot state on the fast tier)."""

    def __init__(
        self,
        columns: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rotary: bool,
        alpha: float,
        max_fetch: float,
        scaling: float,
        overlap: bool,
        pooled: bool,
    ) -> None:
        super().__init__(overlap)
        self.columns, self.weight, self.bias, self.rotary = columns, weight, bias, rotary
        self.alpha, self.max_fetch, self.scaling, self.pooled = alpha, max_fetch, scaling, pooled
        self.specs = {"partial": StateSpec(weight.dtype, (columns.shape[-1],), with_kv=False)}
        if pooled:  # what the bounded pool's eviction rules read
            history = StateSpec(torch.float32, with_kv=False)  # read with the speculation, on the fast tier
            self.specs |= {"fetches": history, "last_fetch": history}
        self.steps = 0

    def store(self, slots: Slots, where: torch.Tensor | slice, key_states: torch.Tensor) -> None:
        b, _, q, _ = key_states.shape
        partial = key_states.gather(-1, self.columns[None, :, None, :].expand(b, -1, q, -1))
        store = slots.state["partial"]
        if isinstance(where, slice):
            store[:, :, where] = partial.to(store.device)
        else:
            store.scatter_(2, expand_to(where, store), partial.to(store.device))
        if self.pooled:
            last = slots.state["last_fetch"]
            if isinstance(where, slice):
                last[:, :, where] = self.steps
            else:
                last.scatter_(2, where, float(self.steps))

    def choose(
        self, layer: KVLayer, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, stored: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = layer.slots
        if self.rotary:
            cos, sin = cos[:, :, self.columns], sin[:, :, self.columns]  # (b, q, h, c)
        else:
            cos = sin = None
        pq = partial_query(x, self.weight, self.bias, cos, sin)
        partial = slots.state["partial"][:, :, :stored]
        scores = speculative_scores(pq, partial, self.scaling)[:, :, :, -1]
        held = layer.held_before if layer.pending else slots.held
        if any(h < stored for h in held):  # padding or evicted slots must not be fetched
            scores = scores.masked_fill(~slots.state["valid"][:, :, None, :stored], -math.inf)
        cap = torch.tensor([max(1, math.ceil(self.max_fetch * h)) for h in held], device=scores.device)
        rows, fetch = select_tokens(scores, self.alpha, cap)
        if self.pooled:  # the bounded pool's eviction needs the fetch history
            self.steps += 1
            slots.state["fetches"].scatter_add_(2, rows, fetch.float())
            slots.state["last_fetch"].scatter_reduce_(2, rows, torch.where(fetch, float(self.steps), 0.0), "amax")
        return rows, fetch


class PoolRule(Rule):
    """The bounded pool's eviction (InfiniGen's Table 2): the entry ranked lowest goes, but never
    one of the newest tenth of the pool, so a token is not dropped before it could be fetched."""

    def ranking(self, slots: Slots, at: Scoring) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, slots: Slots, at: Scoring) -> torch.Tensor:
        position = slots.state["position"][:, :, : at.length]
        protected = position > at.newest - torch.ceil(at.capacity * 0.1)
        return torch.where(protected, math.inf, self.ranking(slots, at))


class Counter(PoolRule):
    name = "counter"

    def ranking(self, slots: Slots, at: Scoring) -> torch.Tensor:
        return slots.state["fetches"][:, :, : at.length]  # the fewest fetches so far


class LeastRecent(PoolRule):
    name = "lru"

    def ranking(self, slots: Slots, at: Scoring) -> torch.Tensor:
        return slots.state["last_fetch"][:, :, : at.length]  # the least recently fetched


class Oldest(PoolRule):
    name = "fifo"

    def ranking(self, slots: Slots, at: Scoring) -> torch.Tensor:
        return slots.state["position"][:, :, : at.length].float()


POOL_RULES = {rule.name: rule for rule in (Counter, LeastRecent, Oldest)}


@register
class InfiniGen(Policy):
    """Speculative fetching of the few tokens each layer needs, from a slow tier holding them all.

    Needs a preparation per model (``prepare``: rank each KV head's rotary pairs on a calibration
    text, saved next to the model), run explicitly before caches are built.
    """

    name = "infinigen"
    takes_budget = False
    needs_preparation = True
    options = (
        Option("alpha", float, 4.0, "fetch tokens with logit > max - alpha, >= 0 (inf: all)", lambda a: a >= 0),
        Option(
            "partial_ratio",
            float,
            0.3,
            "share of each head's dims in the partial weights, in (0, 1]",
            lambda r: 0 < r <= 1,
        ),
        Option(
            "max_fetch", float, 0.2, "cap on tokens fetched, as a share of tokens seen, in (0, 1]", lambda r: 0 < r <= 1
        ),
        Option("dense_layers", int, 2, "first layers that always use their full cache, >= 0", lambda n: n >= 0),
        Option("no_overlap", bool, False, "fetch synchronously instead of overlapping the previous layer"),
        Option(
            "pool_capacity",
            float,
            0.0,
            "bound the slow tier: a fraction of tokens seen (<= 1) or tokens; 0 = unbounded",
            lambda c: c >= 0,
        ),
        Option(
            "eviction",
            str,
            "",
            "with --pool-capacity: counter (default), lru or fifo",
            lambda e: e in ("", *POOL_RULES),
        ),
    )

    def __init__(self, budget: float | None = None, capacity: int | None = None, **params: Any) -> None:
        super().__init__(budget, capacity, **params)
        if self.params["eviction"] and not self.params["pool_capacity"]:
            raise InfinikvError("--eviction needs --pool-capacity (the pool is unbounded otherwise)")
        pool = self.params["pool_capacity"]
        self.pool = None if not pool else Budget(fraction=pool) if pool <= 1 else Budget(tokens=int(pool))
        self.prep: dict[str, Any] | None = None  # the calibration (``prepare``, or set by hand)
        self.prepared_for: str | None = None

    def prepare(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        progress: bool = False,
        calibration: str | None = None,
        tokens: int | None = None,
        force: bool = False,
    ) -> str | None:
        """Load the model's saved calibration, or calibrate (default: ``DEFAULT_CALIBRATION``, 2,048
        tokens) and save it next to the model."""
        if self.prep is not None and self.prepared_for == model.name_or_path and not force:
            return None
        path, did = prep_path(model), None
        if force or not path.is_file():
            text = calibration or DEFAULT_CALIBRATION
            prepare(model, tokenizer, text, tokens or 2048, progress=progress)
            did = f"infinigen: calibrated {model.name_or_path} on {text}, saved to {path}"
        self.prep, self.prepared_for = json.loads(path.read_text()), model.name_or_path
        return did

    def prepared_on(self) -> str | None:
        return None if self.prep is None else self.prep.get("calibration")

    def make_cache(self, model: torch.nn.Module, max_length: int | None = None, static: bool = False) -> KVCache:
        if self.prep is None:
            raise InfinikvError(
                "infinigen needs its calibration for this model: run `infinikv prepare --model MODEL` "
                "(or policy.prepare(model, tokenizer)) first"
            )
        self.modules = attention_modules(model)
        self.rotary = is_rotary(model)
        return super().make_cache(model, max_length, static)

    def layer(self, index: int, model: torch.nn.Module, static: int | None) -> KVLayer:
        if index < self.params["dense_layers"]:
            return KVLayer(Slots())
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        module = self.modules[index]
        columns = kept_columns(self.prep, index, self.rotary, self.params["partial_ratio"], head_dim)
        columns = columns.to(module.q_proj.weight.device)
        weight, bias = partial_weights(module, columns)
        pooled = self.pool is not None
        speculation = Speculation(
            columns,
            weight,
            bias,
            self.rotary,
            self.params["alpha"],
            self.params["max_fetch"],
            module.scaling,
            not self.params["no_overlap"],
            pooled,
        )
        rule = POOL_RULES[self.params["eviction"] or "counter"]() if pooled else None
        return KVLayer(Slots(home=slow_tier(model)), rule, self.pool, fetcher=speculation)

    def worst_case_tokens(self, config: Any, prompt_tokens: int, max_new_tokens: int) -> int:
        total = prompt_tokens + max_new_tokens
        if self.pool is None:
            return total
        return min(total, max(prompt_tokens, self.pool.capacity(total) + 1))
