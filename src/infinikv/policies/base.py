"""The KV-policy interface: a policy builds one ``KVLayer`` per model layer inside a ``KVCache``.

A ``KVLayer`` is a transformers cache layer (``CacheLayerMixin``) that stores K/V in *slots*.
Each forward of a layer goes through four calls, always in this order:

1. ``update(k, v)`` (called by the model): write the ``q`` new tokens into free slots and
   return every stored slot plus the new ones (new tokens last);
2. ``admit(new_valid)`` (called by infinikv's attention function): which new tokens are real,
   not left padding (only the attention mask knows);
3. ``observe(mass, last)``: attention probabilities, for policies that score tokens
   (``observes_attention = True``);
4. ``commit()``: evict down to the budget, in place, by the policy's ``priority``.

Slots are kept per sequence and per KV head, so each row (b, h) keeps its own tokens; the order
of slots carries no meaning because infinikv's attention builds its own mask from ``valid``.
The layer counts every token *seen* (``cumulative_length``), which drives RoPE positions and
``generate``'s input slicing, while ``used`` counts slots physically stored.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import InfinikvError
from ..rope import RotaryTable, evicted_before, rotate


@dataclass(frozen=True)
class Option:
    """A policy parameter, exposed as ``--NAME`` on the command line."""

    name: str
    type: type
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None  # a value is accepted when check(value) is true

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, value: Any) -> Any:
        try:
            parsed = self.type(value)
        except (TypeError, ValueError):
            raise InfinikvError(f"{self.flag} expects {self.type.__name__}, got {value!r}") from None
        if self.check is not None and not self.check(parsed):
            raise InfinikvError(f"{self.flag} {parsed} is out of range ({self.help})")
        return parsed


@dataclass(frozen=True)
class Budget:
    """How many tokens a layer may keep: a fraction of the tokens seen, or a fixed count."""

    fraction: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.tokens is None):
            raise InfinikvError("give exactly one of --budget FRACTION or --capacity TOKENS")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise InfinikvError(f"--budget must be in (0, 1], got {self.fraction}")
        if self.tokens is not None and self.tokens < 1:
            raise InfinikvError(f"--capacity must be at least 1 token, got {self.tokens}")

    def capacity(self, seen: torch.Tensor) -> torch.Tensor:
        """Tokens each sequence may keep, given the real tokens it has seen ``(b,) -> (b,)``."""
        if self.tokens is not None:
            return torch.full_like(seen, self.tokens)
        return torch.ceil(seen * self.fraction).long().clamp(min=1)

    def __str__(self) -> str:
        return f"{self.fraction:g}" if self.fraction is not None else f"{self.tokens} tokens"


class KVLayer(CacheLayerMixin):
    """A cache layer that stores K/V in slots and evicts by a policy's priority.

    With ``budget=None`` it keeps everything (the ``full`` policy). Subclasses that evict
    implement ``priority``; those that need attention weights set ``observes_attention``.
    """

    is_sliding = False
    is_croppable = False  # eviction makes "drop the last n tokens" meaningless
    is_compileable = False
    observes_attention: ClassVar[bool] = False

    def __init__(self, budget: Budget | None = None, fixed: bool = False) -> None:
        super().__init__()
        self.budget = budget
        # fixed: the capacity is settled by the first chunk (``--budget`` x its length, or
        # ``--capacity``) and the storage is allocated once for it, never to grow again.
        self.fixed = fixed
        self.fixed_capacity: int | None = None  # storage slots, less the spare one
        self.row_capacity: torch.Tensor | None = None  # (b,) a fixed layer's capacity per sequence
        self._storage: tuple | None = None  # the fixed storage while a large chunk is staged
        self.cumulative_length = 0  # tokens seen, padding included; reset() zeroes it
        self.used = 0  # slots holding a token, the same count in every row
        self.pending = 0  # newest slots written by update() and not yet committed
        self.meta: dict[str, torch.Tensor] = {}  # per-slot state, each (b, h, S)
        self.real_seen: torch.Tensor | None = None  # (b,) real tokens seen per sequence
        self.trace: list[tuple[int, int, float]] = []  # per forward: (q, seen, keys attended)
        self.clock: dict[str, float] = defaultdict(float)  # seconds spent per phase (see bench speed)
        self.peak_bytes = 0
        # RoPE angles when kept keys are renumbered by rank (bct --positions rank), else None
        self.rank_angles: RotaryTable | None = None
        self.rank_after = 0  # a sequence uses ranks once it has seen more real tokens than this

    # -- storage ---------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_empty(b, h, 0, d)
        self.values = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self.meta = {
            "valid": torch.zeros(b, h, 0, dtype=torch.bool, device=self.device),
            "position": torch.zeros(b, h, 0, dtype=torch.long, device=self.device),
            # evicted tokens older than the slot's: its rank among kept tokens is position - shift
            **({"shift": torch.zeros(b, h, 0, dtype=torch.long, device=self.device)} if self.repositions else {}),
            **{
                name: torch.zeros(b, h, 0, dtype=dtype, device=self.device) for name, dtype in self.extra_meta().items()
            },
        }
        self.real_seen = torch.zeros(b, dtype=torch.long, device=self.device)
        self.is_initialized = True
        if self.fixed:
            budget = self.budget
            q = key_states.shape[2]
            self.fixed_capacity = budget.tokens if budget.tokens is not None else max(1, math.ceil(budget.fraction * q))
            self._grow(self.fixed_capacity + 1)  # one spare slot: a decode step attends before it evicts

    def extra_meta(self) -> dict[str, torch.dtype]:
        """Per-slot state a policy adds (name -> dtype); moved along with its slot on eviction."""
        return {}

    def initial_meta(self, name: str) -> float:
        """The value a new token's slot starts with in the extra state ``name``."""
        return 0

    def slot_tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, *self.meta.values()]

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` slots.

        Growing layers grow geometrically (appends amortised O(1)). A fixed layer never grows:
        a chunk larger than its spare room is staged in temporary tensors, and ``commit``
        writes the survivors back into the fixed storage.
        """
        size = self.keys.shape[2]
        if slots <= size:
            return
        if self.fixed:
            self._storage = (self.keys, self.values, self.meta)
            self._grow(slots)
        else:
            self._grow(max(slots, 2 * size, 16))

    def _grow(self, new_size: int) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(*t.shape[:2], new_size, *t.shape[3:])
            out[:, :, : self.used] = t[:, :, : self.used]
            return out

        self.keys, self.values = grown(self.keys), grown(self.values)
        self.meta = {name: grown(t) for name, t in self.meta.items()}

    def _unstage(self) -> None:
        """Copy the surviving slots of a staged chunk back into the fixed storage."""
        keys, values, meta = self._storage
        keys[:, :, : self.used] = self.keys[:, :, : self.used]
        values[:, :, : self.used] = self.values[:, :, : self.used]
        for name, t in meta.items():
            t[:, :, : self.used] = self.meta[name][:, :, : self.used]
        self.keys, self.values, self.meta, self._storage = keys, values, meta, None

    # -- the transformers contract ---------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending:
            raise InfinikvError(
                "this model's attention does not run through infinikv: call infinikv.attach(model) "
                "(infinikv.load_model does it) before using an infinikv cache"
            )
        q = key_states.shape[2]
        start, end = self.used, self.used + q
        self.reserve(end)
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        positions = (kwargs.get("kwargs") or {}).get("position_ids")
        if positions is None:
            positions = torch.arange(self.cumulative_length, self.cumulative_length + q, device=self.device)
        self.meta["position"][:, :, start:end] = positions.to(self.device).view(-1, 1, q)
        self.meta["valid"][:, :, start:end] = True
        for name in self.extra_meta():
            self.meta[name][:, :, start:end] = self.initial_meta(name)
        self.cumulative_length += q
        self.pending = q
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Every stored slot is visible and the new tokens are causal among themselves.
        return self.used + query_length, self.cumulative_length - self.used

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self.used = self.pending = self.peak_bytes = 0
        self.row_capacity = None
        self.trace.clear()
        if self.is_initialized:
            for t in self.meta.values():
                t.zero_()
            self.real_seen.zero_()

    # -- infinikv's side of each forward ---------------------------------------------------
    def admit(self, new_valid: torch.Tensor | None) -> None:
        """Mark which of the ``pending`` new tokens are real ``(b, q)``; None means all are."""
        q = self.pending
        if new_valid is None:
            self.real_seen += q
            return
        self.meta["valid"][:, :, self.used : self.used + q] = new_valid.view(-1, 1, q)
        self.real_seen += new_valid.sum(-1).to(self.real_seen.dtype).expand_as(self.real_seen)

    def starts_clean(self) -> bool:
        """True for a first chunk of several real tokens: attention is then plainly causal."""
        return self.used == 0 and self.pending > 1 and bool(self.meta["valid"][:, :, : self.pending].all())

    def visibility(self) -> torch.Tensor | None:
        """Which stored keys each new query sees ``(b, h, q, L)``, or None when it sees all of them.

        Stored keys are visible when valid; the ``q`` new keys are causal among themselves, and a
        new token always sees itself (so a padding query still has one key to attend to).
        """
        q, length = self.pending, self.used + self.pending
        valid = self.meta["valid"][:, :, :length]
        if q == 1 and bool(valid.all()):
            return None
        causal = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        visible = valid[:, :, None, :].expand(-1, -1, q, -1).clone()
        visible[:, :, :, self.used :] &= causal
        visible[:, :, :, self.used :] |= torch.eye(q, dtype=torch.bool, device=self.device)
        return visible

    @property
    def repositions(self) -> bool:
        return self.rank_angles is not None

    def positioned(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries (b, H, q, d) and keys (b, h, L, d) to attend with.

        Unchanged unless the layer repositions: then each key sits at its rank among the kept
        tokens and each query right after them, so positions never outgrow the capacity (see
        ``infinikv.rope``), in sequences that have seen more than ``rank_after`` tokens. Without
        eviction, or below that length, both are returned as they are, bit for bit.
        """
        if not self.repositions:
            return query, key
        length = self.used + self.pending
        evicted = self.real_seen[:, None] - self.meta["valid"][:, :, :length].sum(-1)  # (b, h)
        shift = self.meta["shift"][:, :, :length]
        shift[:, :, self.used :] = evicted[..., None]  # every evicted token is older than a new one
        ranked = (self.real_seen > self.rank_after)[:, None]  # (b, 1)
        if not bool((evicted * ranked).any()):
            return query, key
        evicted, shift = evicted * ranked, shift * ranked[..., None]
        b, n_heads, q, d = query.shape
        n_kv = key.shape[1]
        cos, sin = self.rank_angles(evicted[:, :, None, None])  # the queries move back by the evictions
        moved_query = rotate(query.reshape(b, n_kv, -1, q, d), cos, -sin).reshape(b, n_heads, q, d)
        cos, sin = self.rank_angles(shift)
        return moved_query, rotate(key, cos, -sin)

    def speculate(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Called as the *previous* layer's attention starts, with its input ``x`` (b, q, D) and
        the RoPE ``(cos, sin)``: a layer that fetches ahead (InfiniGen) starts its fetch here."""

    def logit_bias(self) -> torch.Tensor | None:
        """An additive bias per stored slot ``(b, h, L)`` (e.g. log-weights of merged slots)."""
        return None

    def observe(self, mass: torch.Tensor, last: torch.Tensor) -> None:
        """Attention received by each slot ``(b, h, L)``: ``mass`` summed over this forward's
        queries and the KV head's query heads; ``last`` from the newest query only."""

    def priority(self, length: int, capacity: torch.Tensor) -> torch.Tensor:
        """Keep-priority of the first ``length`` slots ``(b, h, L)``: the highest are kept."""
        raise NotImplementedError

    def capacity(self) -> torch.Tensor:
        """Tokens each sequence may keep now ``(b,)``."""
        if not self.fixed:
            return self.budget.capacity(self.real_seen)
        if self.row_capacity is None:  # settled once, by the real tokens of the first chunk
            self.row_capacity = self.budget.capacity(self.real_seen)
        return self.row_capacity

    def commit(self, attended: float) -> None:
        """Close this forward: log it, then evict down to the budget."""
        length = self.used + self.pending
        self.trace.append((self.pending, self.cumulative_length, attended))
        self.used, self.pending = length, 0
        if self.budget is not None:
            capacity = self.capacity()
            valid = self.meta["valid"][:, :, :length]
            if bool((valid.sum(-1) > capacity[:, None]).any()):
                priority = self.priority(length, capacity).masked_fill(~valid, -math.inf)
                rank = priority.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
                keep = valid & (rank < capacity[:, None, None])
                if self.repositions:
                    position = self.meta["position"][:, :, :length]
                    self.meta["shift"][:, :, :length] += evicted_before(position, valid & ~keep)
                self.evict(keep)
        if self._storage is not None:
            self._unstage()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def evict(self, keep: torch.Tensor) -> None:
        """Drop every valid slot outside ``keep`` ``(b, h, L)``."""
        self.compact(keep)

    def compact(self, keep: torch.Tensor) -> None:
        """Drop the slots not in ``keep`` ``(b, h, L)`` by moving kept tail slots into holes.

        Only the slots that move are copied (in place); rows keeping fewer tokens than the
        longest row are left with invalid slots, which the attention mask hides.
        """
        length = keep.shape[-1]
        kept = int(keep.sum(-1).max())
        pairs = min(kept, length - kept)
        self.meta["valid"][:, :, :length] &= keep
        if pairs > 0:
            head, tail = keep[:, :, :kept], keep[:, :, kept:]
            holes = torch.sort(head.to(torch.uint8), dim=-1, stable=True).indices[..., :pairs]
            movers = torch.sort((~tail).to(torch.uint8), dim=-1, stable=True).indices[..., :pairs] + kept
            n_moves = tail.sum(-1, keepdim=True)
            sources = torch.where(torch.arange(pairs, device=keep.device) < n_moves, movers, holes)
            for t in self.slot_tensors():
                src, dst = sources.to(t.device), holes.to(t.device)  # a slow tier may live elsewhere
                if t.dim() == 4:
                    src = src[..., None].expand(-1, -1, -1, t.shape[-1])
                    dst = dst[..., None].expand(-1, -1, -1, t.shape[-1])
                t.scatter_(2, dst, t.gather(2, src))
        self.used = kept

    def held_bytes(self) -> int:
        """Bytes of K/V in the slots in use."""
        return self.used * self.bytes_per_slot()

    def allocated_bytes(self) -> int:
        """Bytes of K/V storage allocated (slots in use plus room to grow)."""
        return self.keys.shape[2] * self.bytes_per_slot() if self.is_initialized else 0

    def bytes_per_slot(self) -> int:
        if not self.is_initialized:
            return 0
        b, h, _, d = self.keys.shape
        return b * h * (d + self.values.shape[-1]) * self.keys.element_size()


class KVCache(Cache):
    """The one object that carries KV state across layers: a ``Cache`` of ``KVLayer`` objects."""

    def __init__(self, layers: list[KVLayer], policy: Policy) -> None:
        super().__init__(layers=layers)
        self.policy = policy

    def before_attention(self, layer_idx: int, x: torch.Tensor, position_embeddings: Any) -> None:
        """Layer ``layer_idx``'s attention is about to run on ``x``: let the next layer prepare."""
        if layer_idx + 1 < len(self.layers):
            self.layers[layer_idx + 1].speculate(x, position_embeddings)

    def clock(self) -> dict[str, float]:
        """Seconds spent per phase (speculate, fetch, attend), summed over layers since reset."""
        total: dict[str, float] = defaultdict(float)
        for layer in self.layers:
            for phase, seconds in layer.clock.items():
                total[phase] += seconds
        return dict(total)

    def reset_clock(self) -> None:
        for layer in self.layers:
            layer.clock.clear()

    def transfer_summary(self) -> dict[str, float] | None:
        """Slow->fast traffic per decode step, for policies with two tiers (else None)."""
        logs = [layer.transfers for layer in self.layers if getattr(layer, "transfers", None)]
        if not logs:
            return None
        steps = max(len(log) for log in logs)
        fetched = [tokens / seen for log in logs for seen, tokens, _ in log]
        moved = sum(nbytes for log in logs for _, _, nbytes in log)
        return {
            "fetched_fraction": sum(fetched) / len(fetched),
            "tokens_fetched_per_step": sum(t for log in logs for _, t, _ in log) / steps,
            "bytes_moved_per_step": moved / steps,
        }

    def held_bytes(self) -> int:
        return sum(layer.held_bytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def peak_bytes(self) -> int:
        return sum(layer.peak_bytes for layer in self.layers)

    def attended(self, decode_only: bool = True) -> tuple[list[float], list[float]]:
        """Mean keys attended per forward, and that divided by the tokens seen, per layer."""
        counts, fractions = [], []
        for layer in self.layers:
            rows = [(seen, n) for q, seen, n in layer.trace if q == 1 or not decode_only]
            counts.append(sum(n for _, n in rows) / max(len(rows), 1))
            fractions.append(sum(n / seen for seen, n in rows) / max(len(rows), 1))
        return counts, fractions


class Policy(ABC):
    """A KV policy: its name, its budget and parameters, and how to build its layers.

    Subclasses set ``name``, a docstring saying what they keep and why, their ``options``,
    and implement ``make_layer``. ``bounded = False`` marks policies that take no budget.
    """

    name: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    bounded: ClassVar[bool] = True

    def __init__(self, budget: float | None = None, capacity: int | None = None, **params: Any) -> None:
        known = {o.name: o for o in self.options}
        unknown = set(params) - set(known)
        if unknown:
            raise InfinikvError(f"policy {self.name!r} has no parameter {sorted(unknown)[0]!r}")
        self.params = {name: o.parse(params.get(name, o.default)) for name, o in known.items()}
        self.budget = self.make_budget(budget, capacity)

    def make_budget(self, budget: float | None, capacity: int | None) -> Budget | None:
        """The budget from ``--budget``/``--capacity``; unbounded policies ignore both."""
        if not self.bounded:
            return None
        if budget is None and capacity is None:
            raise InfinikvError(f"policy {self.name!r} needs --budget FRACTION or --capacity TOKENS")
        return Budget(budget, capacity)

    @abstractmethod
    def make_layer(self, layer_idx: int) -> KVLayer: ...

    def make_cache(self, model: torch.nn.Module) -> KVCache:
        """A fresh cache for one generation (or one batch) with ``model``."""
        return KVCache([self.make_layer(i) for i in range(model.config.num_hidden_layers)], self)

    def describe(self) -> dict[str, Any]:
        budget = self.budget
        return {
            "policy": self.name,
            "budget": budget.fraction if budget else None,
            "capacity": budget.tokens if budget else None,
            **self.params,
        }

    def __repr__(self) -> str:
        parts = ([f"budget={self.budget}"] if self.budget else []) + [f"{k}={v}" for k, v in self.params.items()]
        return f"{self.name}({', '.join(parts)})" if parts else self.name
