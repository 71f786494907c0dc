"""``merge`` eviction rule (after CaM, Zhang et al. 2024, and D2O, Wan et al. 2024): heavy-hitter
eviction, but the evicted K/V is folded into its most similar kept slot as a weighted mean, and
attention adds log(weight) to that slot's logit; a ``bct`` update rule."""

import math

import torch

from ..kv.slots import Slots, StateSpec, expand_to
from . import register_rule
from .h2o import HeavyHitter


@register_rule
class Merge(HeavyHitter):
    """As ``heavy-hitter``, but each victim is folded into the kept slot with the most similar key."""

    name = "merge"
    state = {**HeavyHitter.state, "weight": StateSpec(torch.float32, initial=1.0)}  # tokens folded into a slot

    def logit_bias(self, slots: Slots, length: int) -> torch.Tensor:
        return slots.state["weight"][:, :, :length].log()

    def evict(self, slots: Slots, victims: torch.Tensor, take: torch.Tensor | None, length: int) -> None:
        """Victims (b, h, k). A kept slot's K/V become the weighted mean of what it held and what joins
        it, and its weight the sum, so the total weight always equals the tokens seen."""
        keys, values = slots.view(length)
        weight, valid = slots.state["weight"][:, :, :length], slots.state["valid"][:, :, :length]
        joining = torch.ones_like(victims, dtype=torch.bool) if take is None else take
        keep = valid.scatter(2, victims, valid.gather(2, victims) & ~joining)
        moved = weight.gather(2, victims) * joining  # what each victim carries (nothing where not taken)
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)
        similarity = unit.gather(2, expand_to(victims, unit)) @ unit.transpose(-1, -2)  # (b, h, k, L)
        target = similarity.masked_fill(~keep[:, :, None, :], -math.inf).argmax(-1)  # (b, h, k)
        new_weight = weight.scatter_add(-1, target, moved)
        for store in (keys, values):
            joined = store.gather(2, expand_to(victims, store)) * moved[..., None]
            summed = (store * weight[..., None]).scatter_add_(2, expand_to(target, store), joined)
            store.copy_(torch.where(keep[..., None], summed / new_weight[..., None], store))
        weight.copy_(torch.where(keep, new_weight, weight))
        slots.drop(victims, take)
