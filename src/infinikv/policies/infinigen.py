"""``infinigen``: InfiniGen (Lee et al., "InfiniGen: Efficient Generative Inference of Large
Language Models with Dynamic KV Cache Management", OSDI 2024). Every token's K/V stays in the
slow tier; one layer ahead, a cheap rehearsal with the previous layer's attention input, a
partial query weight and a partial key cache guesses which few tokens each KV head will attend
to, and only those are fetched. Nothing is ever dropped, so a token ignored now can be fetched
again later. The first ``dense_layers`` layers and the prefill attend to everything; a layer
the model bounds to a sliding window keeps its window (``window``) and neither speculates nor
fetches.

For RoPE models the partial columns are whole rotary pairs, chosen per KV head offline
(``infinikv prepare``), so the partial dot product is exact for the kept pairs. A model with
QK-norm (Gemma 3) normalizes each query head by the RMS of all its columns: speculation
estimates it from the kept ones (``normalize_partial``, calibrated per column).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..errors import InfinikvError
from ..kv.rope import rotary_inv_freq
from ..kv.slots import Slots, StateSpec, expand_to
from ..speculation import (
    column_scores,
    pair_scores,
    pairs_to_columns,
    partial_query,
    select_by_mass,
    select_tokens,
    skew_matrices,
    speculative_scores,
)
from . import register
from .base import Budget, Option, Policy, Rule, Scoring, sliding_window
from .layer import Fetcher, KVCache, KVLayer
from .offload import slow_tier

PREP_FILE = "infinikv-infinigen.json"
DEFAULT_CALIBRATION = "austen:persuasion"
CALIBRATION_TOKENS = 4096
PREP_VERSION = 2  # 2: the coverage curves of the mass rule
# the speculated masses whose true coverage calibration measures, per layer
MASS_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 1.0)
PARTIAL_RATIO, MAX_FETCH, KEEP_FIRST, KEEP_RECENT, COVERAGE = 0.3, 0.2, 4, 32, 0.92
CURVE_QUERIES = 128  # decode positions per layer the curves average over


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
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    return captured


def queries_and_keys(module: torch.nn.Module, x: torch.Tensor, rope: Any) -> tuple[torch.Tensor, ...]:
    """What ``module`` attends with for its input x (1, n, D): queries (n, H, d) and keys (n, h, d)
    post-norm and post-RoPE, and the queries' mean square per column before any QK-norm (H, d)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = module.q_proj(x).view(*x.shape[:2], -1, module.head_dim).transpose(1, 2)
    k = module.k_proj(x).view(*x.shape[:2], -1, module.head_dim).transpose(1, 2)
    square = q[0].pow(2).mean(1)
    if getattr(module, "q_norm", None) is not None:
        q, k = module.q_norm(q), module.k_norm(k)
    if rope is not None:
        q, k = apply_rotary_pos_emb(q, k, *rope)
    return q[0].transpose(0, 1), k[0].transpose(0, 1), square


@torch.inference_mode()
def calibrate(model: torch.nn.Module, ids: torch.Tensor, progress: bool = False) -> dict[str, Any]:
    """Rank each KV head's rotary pairs (and single columns) by how much of q.k they carry, and
    measure each layer's coverage curve for the mass rule (``coverage_curve``).

    Runs ``ids`` (1, n) through the model once and uses every layer's post-RoPE queries and
    keys. Returns ``{"pair_ranking": [layer][kv head][pairs, best first], "column_ranking": ...,
    "coverage"/"fetched": [layer][one per MASS_GRID]}`` (layer 0, with no layer before it,
    speculates from its own input), and for a QK-norm model ``"query_square"``: [layer][query
    head][column], the mean square of its queries before the norm. A sliding-window layer, which
    never speculates, gets None in each list.
    """
    prep: dict[str, Any] = {"pair_ranking": [], "column_ranking": [], "coverage": [], "fetched": []}
    modules = attention_modules(model)
    rotary, previous = is_rotary(model), None
    normed = any(getattr(m, "q_norm", None) is not None for m in modules.values())
    if normed:
        prep["query_square"] = []
    for index, (x, rope) in sorted(attention_inputs(model, ids, progress).items()):
        module, before, previous = modules[index], previous, x
        if sliding_window(model.config, index) is not None:
            for name in prep:
                prep[name].append(None)
            continue
        q, k, square = queries_and_keys(module, x, rope)  # (n, H, d), (n, h, d), (H, d)
        prep["pair_ranking"].append(pair_scores(q, k).argsort(-1, descending=True).tolist())
        prep["column_ranking"].append(column_scores(q, k).argsort(-1, descending=True).tolist())
        if normed:
            prep["query_square"].append(square.tolist())
        columns = kept_columns(prep, index, rotary, PARTIAL_RATIO, module.head_dim)
        norm = query_norm(module, prep, index, columns)
        coverage, fetched = coverage_curve(module, x if before is None else before, rope, q, k, columns, norm)
        prep["coverage"].append(coverage)
        prep["fetched"].append(fetched)
    fit = {"partial_ratio": PARTIAL_RATIO, "max_fetch": MAX_FETCH, "keep_first": KEEP_FIRST, "keep_recent": KEEP_RECENT}
    return {**prep, "mass_grid": list(MASS_GRID), "fit": fit, "tokens": int(ids.shape[1])}


def coverage_curve(
    module: torch.nn.Module,
    x: torch.Tensor,
    rope: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    columns: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[list[float], list[float]]:
    """How much true attention mass the mass rule covers, and what share it fetches, at each
    speculated mass of ``MASS_GRID``, as a decode step would see it: speculation from the
    previous layer's attention input x (1, n, D) with this layer's partial weights, against the
    true attention of this layer's queries q (n, H, d) over its keys k (n, h, d), post-RoPE, at
    ``CURVE_QUERIES`` positions of the second half. The current token (always attended) counts.
    ``norm``: the QK-norm estimate of a partial query (``query_norm``), or None.
    """
    n, h = k.shape[0], k.shape[1]
    at = torch.linspace(n // 2, n - 1, min(CURVE_QUERIES, n - n // 2), device=q.device).long().unique()  # (T,)
    positions = torch.arange(n, device=q.device)
    stored = positions[None, :] < at[:, None]  # (T, n): the tokens a step at ``at`` may fetch
    logits = torch.einsum("thgd,nhd->thgn", q[at].view(len(at), h, -1, q.shape[-1]), k) * module.scaling
    truth = logits.masked_fill(positions > at[:, None, None, None], -math.inf).softmax(-1).mean(2)  # (T, h, n)
    current = truth.gather(-1, at[:, None, None].expand(-1, h, 1))[..., 0]  # (T, h)
    weight, bias = partial_weights(module, columns)
    cos = sin = None
    if rope is not None:
        cos, sin = (r[0, at][:, columns][:, None] for r in rope)  # (T, 1, h, c)
    pq = partial_query(x[0, at][:, None], weight, bias, cos, sin, norm)  # (T, h, g, 1, c)
    partial = k.gather(-1, columns[None].expand(n, -1, -1)).transpose(0, 1)  # (h, n, c)
    scores = speculative_scores(pq, partial[None], module.scaling)[:, :, :, 0]  # (T, h, g, n)
    scores = scores.masked_fill(~stored[:, None, None], -math.inf)
    cap = (at * MAX_FETCH).ceil().long().clamp(min=1).tolist()
    resident = stored & ((positions < KEEP_FIRST) | (positions >= at[:, None] - KEEP_RECENT))
    coverage, fetched = [], []
    for mass in MASS_GRID:
        rows, fetch = select_by_mass(scores, mass, cap, resident[:, None].expand(-1, h, -1))
        coverage.append(round(float(((truth.gather(-1, rows) * fetch).sum(-1) + current).mean()), 4))
        fetched.append(round(float((fetch.sum(-1) / at[:, None]).mean()), 4))
    return coverage, fetched


def query_norm(
    module: torch.nn.Module, prep: dict[str, Any], layer: int, columns: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """For a QK-norm layer, what ``normalize_partial`` needs at the kept ``columns`` (h, c): the
    norm's gain (h, c), the full-to-kept mean-square ratio (h, g) and its epsilon; else None."""
    norm = getattr(module, "q_norm", None)
    if norm is None:
        return None
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
    ones = torch.ones(module.head_dim, dtype=module.q_proj.weight.dtype, device=columns.device)
    gain = (norm(ones) * math.sqrt(1 + eps))[columns]  # an RMS norm of ones is its gain
    square = torch.tensor(prep["query_square"][layer], device=columns.device)  # (H, d)
    square = square.view(columns.shape[0], -1, square.shape[-1])  # (h, g, d)
    kept = square.gather(2, columns[:, None, :].expand(-1, square.shape[1], -1)).mean(-1)
    return gain, (square.mean(-1) / kept.clamp(min=1e-12)).to(gain.dtype), eps


def chosen_mass(prep: dict[str, Any], layer: int, target: float) -> float:
    """The smallest speculated mass whose calibrated coverage reaches ``target`` (1: the cap)."""
    curve = prep["coverage"][layer]
    return next((m for m, c in zip(prep["mass_grid"], curve, strict=True) if c >= target), 1.0)


def calibration_table(prep: dict[str, Any], target: float, dense: int) -> str:
    """Per sparse layer: the mass chosen for ``target`` and what it covered and fetched in calibration."""
    lines = [f"{'layer':>5} {'mass':>6} {'coverage':>9} {'fetched':>8}"]
    for layer in range(dense, len(prep["coverage"])):
        if prep["coverage"][layer] is None:  # a sliding-window layer
            continue
        mass = chosen_mass(prep, layer, target)
        at = prep["mass_grid"].index(mass)
        coverage, fetched = prep["coverage"][layer][at], prep["fetched"][layer][at]
        lines.append(f"{layer:>5} {mass:>6.2f} {coverage:>9.3f} {fetched:>7.1%}")
    return "\n".join(lines)


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
    model: torch.nn.Module,
    tokenizer,
    calibration: str = DEFAULT_CALIBRATION,
    tokens: int = CALIBRATION_TOKENS,
    progress: bool = True,
) -> Path:
    """Calibrate on ``tokens`` tokens of a text and save the result next to the model."""
    from ..data import load_text

    path = prep_path(model)
    ids = tokenizer(load_text(calibration, from_chapter_one=True)[: tokens * 8], return_tensors="pt").input_ids
    prep = calibrate(model, ids[:, :tokens].to(next(model.parameters()).device), progress)
    prep["calibration"], prep["version"] = calibration, PREP_VERSION
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
    (the kept columns of every stored key, a per-slot state on the fast tier). The tokens are
    chosen by one of two rules: the mass rule (``mass``: the fewest tokens whose speculated
    softmax mass reaches it, per KV head, plus the ``keep`` resident tokens) or the paper's
    threshold (``alpha``: logits within alpha of the maximum). ``ahead=False`` (layer 0, which
    no layer precedes, and the oracle) speculates at the layer itself, from its own input.
    ``frequencies`` (h, c): the layer's own RoPE frequencies at the kept columns, when the layer it
    speculates from has another RoPE (Gemma 3's local and global bases), else None (its RoPE serves);
    ``norm``: the QK-norm estimate (``query_norm``) or None."""

    def __init__(
        self,
        columns: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rotary: bool,
        rule: dict[str, float],
        scaling: float,
        overlap: bool,
        pooled: bool,
        ahead: bool = True,
        frequencies: torch.Tensor | None = None,
        norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> None:
        super().__init__(overlap)
        self.columns, self.weight, self.bias, self.rotary = columns, weight, bias, rotary
        self.rule, self.scaling, self.pooled, self.ahead = rule, scaling, pooled, ahead
        self.frequencies, self.norm = frequencies, norm
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
        self, layer: KVLayer, x: torch.Tensor, rope: Any, positions: torch.Tensor, stored: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots, rule = layer.slots, self.rule
        pq = self.query(x, rope, positions)
        partial = slots.state["partial"][:, :, :stored]
        scores = speculative_scores(pq, partial, self.scaling)[:, :, :, -1]
        held = layer.held_before if layer.pending else slots.held
        valid = slots.state["valid"][:, :, :stored]
        every_slot = all(h == stored for h in held)
        if not every_slot:  # padding or evicted slots must not be fetched
            scores = scores.masked_fill(~valid[:, :, None], -math.inf)
        ordered = every_slot and not self.pooled  # slot i holds token i
        cap = [max(1, math.ceil(rule["max_fetch"] * h)) for h in held]
        if "alpha" in rule:
            rows, fetch = select_tokens(scores, rule["alpha"], torch.tensor(cap, device=scores.device))
        else:
            rows, fetch = select_by_mass(scores, rule["mass"], cap, self.resident(slots, valid, stored, ordered))
        if self.pooled:  # the bounded pool's eviction needs the fetch history
            self.steps += 1
            slots.state["fetches"].scatter_add_(2, rows, fetch.float())
            slots.state["last_fetch"].scatter_reduce_(2, rows, torch.where(fetch, float(self.steps), 0.0), "amax")
        return rows, fetch

    def query(self, x: torch.Tensor, rope: Any, positions: torch.Tensor) -> torch.Tensor:
        """This layer's partial query (b, h, g, q, c) for the attention input x (b, q, D), given the
        RoPE ``(cos, sin)`` of the layer x fed (or None) and the positions (b, q)."""
        cos = sin = None
        if self.frequencies is not None:
            angles = positions[:, :, None, None].float() * self.frequencies  # (b, q, h, c)
            cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        elif self.rotary:
            cos, sin = rope[0][:, :, self.columns], rope[1][:, :, self.columns]  # (b, q, h, c)
        return partial_query(x, self.weight, self.bias, cos, sin, self.norm)

    def resident(self, slots: Slots, valid: torch.Tensor, stored: int, ordered: bool) -> torch.Tensor | None:
        """The first ``keep_first`` and the newest ``keep_recent`` tokens held: (stored,) when the
        slots hold every token in order (``ordered``), else (b, h, stored) from their positions.
        Nearly every step attends to them, so they are always fetched."""
        first, recent = int(self.rule.get("keep_first", 0)), int(self.rule.get("keep_recent", 0))
        if not first and not recent:
            return None
        if ordered:
            slot = torch.arange(stored, device=valid.device)
            return (slot < first) | (slot >= stored - recent)
        position = slots.state["position"][:, :, :stored]
        newest = position.masked_fill(~valid, -1).amax(-1, keepdim=True)
        return valid & ((position < first) | (position > newest - recent))


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
RULE_OPTIONS = {"alpha": ("alpha",), "mass": ("coverage", "mass", "keep_first", "keep_recent")}  # by --select


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
        Option(
            "select",
            str,
            "mass",
            "how speculation picks tokens: mass (default), alpha (the paper's threshold) or oracle "
            "(the true top --max-fetch share of each layer, an upper bound for comparison)",
            lambda s: s in ("mass", "alpha", "oracle"),
        ),
        Option(
            "coverage",
            float,
            COVERAGE,
            "with --select mass: the share of true attention mass each layer should cover; the mass "
            "per layer that reaches it is read off the calibration, in (0, 1)",
            lambda c: 0 < c < 1,
        ),
        Option(
            "mass",
            float,
            0.0,
            "with --select mass: one speculated mass for every layer instead, in (0, 1] (1: the cap)",
            lambda m: 0 <= m <= 1,
        ),
        Option(
            "alpha", float, 4.0, "with --select alpha: fetch tokens with logit > max - alpha, >= 0", lambda a: a >= 0
        ),
        Option(
            "keep_first",
            int,
            KEEP_FIRST,
            "with --select mass: first tokens always fetched (attention sinks), >= 0",
            lambda n: n >= 0,
        ),
        Option(
            "keep_recent",
            int,
            KEEP_RECENT,
            "with --select mass: newest tokens always fetched, >= 0",
            lambda n: n >= 0,
        ),
        Option(
            "partial_ratio",
            float,
            PARTIAL_RATIO,
            "share of each head's dims in the partial weights, in (0, 1]",
            lambda r: 0 < r <= 1,
        ),
        Option(
            "max_fetch",
            float,
            MAX_FETCH,
            "cap on tokens fetched, as a share of tokens seen, in (0, 1]",
            lambda r: 0 < r <= 1,
        ),
        Option(
            "dense_layers",
            int,
            0,
            "first layers that always use their full cache, >= 0 (at 0, layer 0 speculates from its own input)",
            lambda n: n >= 0,
        ),
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
        select = self.params["select"]
        for rule, names in RULE_OPTIONS.items():
            stray = [name for name in names if name in self.given and rule != select]
            if stray:
                raise InfinikvError(f"--{stray[0].replace('_', '-')} applies to --select {rule}, not {select}")
        if "coverage" in self.given and "mass" in self.given:
            raise InfinikvError("give --coverage (a mass per layer from the calibration) or --mass, not both")
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
        """Load the model's saved calibration, or calibrate (default: ``DEFAULT_CALIBRATION``,
        ``CALIBRATION_TOKENS`` tokens) and save it next to the model; a calibration saved by an
        older version (without coverage curves) is redone."""
        if self.prep is not None and self.prepared_for == model.name_or_path and not force:
            return None
        path, did = prep_path(model), None
        if force or not path.is_file() or json.loads(path.read_text()).get("version") != PREP_VERSION:
            text = calibration or DEFAULT_CALIBRATION
            prepare(model, tokenizer, text, tokens or CALIBRATION_TOKENS, progress=progress)
            did = f"infinigen: calibrated {model.name_or_path} on {text}, saved to {path}"
        self.prep, self.prepared_for = json.loads(path.read_text()), model.name_or_path
        if did and self.params["select"] == "mass" and not self.params["mass"]:
            target = self.params["coverage"]
            dense = self.params["dense_layers"]
            did += f"\nper layer, the mass for {target:.0%} coverage on the calibration text:\n"
            did += calibration_table(self.prep, target, dense)
        return did

    def prepared_on(self) -> str | None:
        return None if self.prep is None else self.prep.get("calibration")

    def rule(self, index: int) -> dict[str, float]:
        """How layer ``index`` picks its tokens (see ``Speculation``)."""
        params, rule = self.params, {"max_fetch": self.params["max_fetch"]}
        if params["select"] == "alpha":
            return rule | {"alpha": params["alpha"]}
        if params["select"] == "oracle":
            return rule | {"mass": 1.0}
        mass = params["mass"] or chosen_mass(self.prep, index, params["coverage"])
        return rule | {"mass": mass, "keep_first": params["keep_first"], "keep_recent": params["keep_recent"]}

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.prep is not None and self.params["select"] == "mass" and not self.params["mass"]:
            first = self.params["dense_layers"]
            curves = self.prep["coverage"]  # None for a sliding-window layer, which does not speculate
            masses = [None if curves[i] is None else self.rule(i)["mass"] for i in range(first, len(curves))]
            out["mass_per_layer"] = masses
        return out

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
        oracle = self.params["select"] == "oracle"  # every column of the layer's own query and keys
        ahead = not oracle and index > 0  # layer 0 has no layer before it: it speculates from its own input
        ratio = 1.0 if oracle else self.params["partial_ratio"]
        columns = kept_columns(self.prep, index, self.rotary, ratio, head_dim).to(module.q_proj.weight.device)
        weight, bias = partial_weights(module, columns)
        frequencies = None
        if self.rotary and ahead:  # speculating from a layer with another RoPE: this layer's own angles
            own, theirs = rotary_inv_freq(model, index), rotary_inv_freq(model, index - 1)
            if own is not None and (theirs is None or not torch.equal(own, theirs)):
                frequencies = own.to(columns.device)[columns % (head_dim // 2)]
        pooled = self.pool is not None
        speculation = Speculation(
            columns,
            weight,
            bias,
            self.rotary,
            self.rule(index),
            module.scaling,
            not self.params["no_overlap"],
            pooled,
            ahead,
            frequencies,
            query_norm(module, self.prep, index, columns),
        )
        rule = POOL_RULES[self.params["eviction"] or "counter"]() if pooled else None
        return KVLayer(Slots(home=slow_tier(model)), rule, self.pool, fetcher=speculation)

    def worst_case_tokens(self, config: Any, prompt_tokens: int, max_new_tokens: int) -> int:
        total = prompt_tokens + max_new_tokens
        if self.pool is None:
            return total
        return min(total, max(prompt_tokens, self.pool.capacity(total) + 1))
