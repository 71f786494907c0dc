"""The decode core: the one place where a model runs over an infinikv cache.

A ``Batch`` is a set of rows decoding together under one policy's cache: it prefills prompts
(left-padded, in chunks), feeds known tokens (teacher forcing, streams) and runs decode steps;
``step_together`` runs one step of several batches in one forward (the server's continuous
batching) and ``sample`` is the generation loop. Every caller (``generate``, the server, every
evaluation, ``bench speed``) goes through here.

Before each forward the core tells the cache what is coming (``KVCache.begin``: tokens per row,
which are padding, their positions), so the cache plans on the host from counts it keeps there
and a steady decode step makes no device-to-host synchronisation. With ``compile=True`` the
decode step of a cache whose shapes are static (``policy.compilable``) runs compiled
(``infinikv.compiled``: built once per machine, then loaded from disk); prefill runs eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from . import compiled
from .cache import GroupedCache, KVCache, join, keep, row_slices
from .errors import InfinikvError
from .forward import forward
from .policies import Policy, reference
from .rereading import FirstReading, Readings, left_padded, second_readings
from .sampling import Sampling, next_tokens, until_stop
from .sizes import model_device


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, real)``, both (b, n) on the CPU, padded on the left; ``real`` is bool."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    real = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
        real[row, width - len(seq) :] = True
    return ids, real


class Batch:
    """Sequences decoding together under one cache (see the module docstring).

    ``policy`` builds the cache (``max_length``: the most tokens a row will see, which sizes the
    storage of a compiled ``full``). ``compile``: run decode steps compiled (``compile_seconds``
    says what getting the compiled step cost: loading it, or building it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        compile: bool = False,
        max_length: int | None = None,
        cache: KVCache | None = None,
    ) -> None:
        self.model, self.policy, self.device = model, policy, model_device(model)
        self.cache = cache if cache is not None else policy.make_cache(model, max_length, static=compile)
        self.compile = compile
        self.next_position = torch.zeros(0, dtype=torch.long, device=self.device)  # (b,) per row
        self.compiled: Callable | None = None
        self.compile_seconds: float | None = None
        self._static: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._signature: tuple = ()
        self._all_real: dict[int, torch.Tensor] = {}
        self.readings: Readings | None = None  # prompts' second readings shared with other batches (a grid's)

    @property
    def rows(self) -> int:
        return self.next_position.shape[0]

    # -- forwards ----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, prompts: Sequence[Sequence[int]], pad_id: int, chunk: int | None = None, keep_all: bool = False
    ) -> torch.Tensor:
        """Feed ``prompts`` (one token list per row, left-padded), ``chunk`` tokens per forward
        (None: the policy's choice, ``Policy.prefill_chunk``). Returns each row's next-token logits
        (b, V), or with ``keep_all`` the logits of every position (b, n, V). A cache that reads its
        prompt twice (``rereading``) and stores it from one forward takes the first reading's K/V."""
        ids, real, firsts = self._start(prompts, pad_id)
        n = ids.shape[1]
        if not firsts or keep_all or (chunk or self.policy.prefill_chunk(self.model, n)) < n:
            return self._read(ids, real, chunk, keep_all)
        kv, logits = left_padded(firsts, n)
        self._store(real, kv)
        return logits.to(self.device)

    @torch.inference_mode()
    def prefill_from(
        self, prompts: Sequence[Sequence[int]], pad_id: int, kv: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """``prefill`` without a forward: ``kv``, each layer's K/V of ``prompts`` (b, h, n, d) as a cache
        that ``reads_as_full`` computed them in this policy's chunks (``KVCache.prompt_kv``), is stored."""
        self._store(self._start(prompts, pad_id)[1], kv)

    def _store(self, real: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store ``kv``, each layer's K/V (b, h, n, d) of the prompts (``real`` (b, n)), as a forward would."""
        n = real.shape[1]
        self.cache.begin(n, *self._place(n, real))
        try:
            self.cache.take([(k.to(self.device), v.to(self.device)) for k, v in kv])
        finally:
            self.cache.end()
        self.prompt_read()

    def _start(self, prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list]:
        """A prompt's first forward comes next: its rows start at position 0, the cache learns their
        lengths (``expect``). Returns them left-padded, ``(ids, real)`` (b, n) on the CPU, and ``expect``'s."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InfinikvError("the prompt is empty")
        self.next_position = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
        firsts = self.expect(prompts)
        return *left_pad(prompts, pad_id), firsts

    def expect(self, prompts: Sequence[Sequence[int]]) -> list[FirstReading]:
        """Before a prompt's first chunk (a caller feeding it itself calls this, then ``prompt_read``
        after its last): its length, and where a rule asks, its second reading (``rereading``): the
        cache takes its scores, the caller each row's first reading (K/V and logits), if it wants."""
        self.cache.expect([len(p) for p in prompts])
        if not (layers := self.cache.rereading()):
            return []
        fresh, chunk = (lambda: Batch(self.model, reference())), self.cache.reread_chunk()
        *scores, firsts = second_readings(fresh, prompts, layers, chunk, self.device, self.readings)
        self.cache.give_prompt_scores(*scores)
        return firsts

    def prompt_read(self) -> None:
        """The prompt is in the cache: its second reading's scores are no longer needed."""
        self.cache.give_prompt_scores(None, None)

    @torch.inference_mode()
    def extend(self, ids: torch.Tensor, keep_all: bool = False, chunk: int | None = None) -> torch.Tensor:
        """Feed known tokens ``ids`` (b, n) after what the rows hold (teacher forcing, a stream),
        ``chunk`` per forward as in ``prefill``. Returns the last position's logits (b, V), or every
        position's (b, n, V) with ``keep_all``."""
        if self.rows == 0:  # a prompt: a budget fraction is of all of it, however it is cut
            self.expect(ids.tolist())
        return self._read(ids, None, chunk, keep_all)

    def _read(self, ids: torch.Tensor, real: torch.Tensor | None, chunk: int | None, keep_all: bool) -> torch.Tensor:
        """Feed ``ids`` (b, n), ``real`` (b, n) marking what is not padding (None: all), in forwards
        of ``chunk`` tokens (None: the policy's choice); the logits ``prefill`` returns."""
        chunk = chunk or self.policy.prefill_chunk(self.model, ids.shape[1])
        outputs = []
        for at in range(0, ids.shape[1], chunk):
            mask = None if real is None else real[:, at : at + chunk]
            outputs.append(self.feed(ids[:, at : at + chunk].to(self.device), mask, keep_all))
        self.prompt_read()
        return torch.cat(outputs, dim=1) if keep_all else outputs[-1]

    @torch.inference_mode()
    def feed(self, ids: torch.Tensor, real: torch.Tensor | None = None, keep_all: bool = False) -> torch.Tensor:
        """One forward of ``ids`` (b, q) on the device; ``real`` (b, q) bool on the CPU marks the
        tokens that are not padding (None: all are). Returns the next-token logits of each row
        (b, V), or of every position (b, q, V) with ``keep_all``."""
        b, q = ids.shape
        if self.rows == 0:
            self.next_position = torch.zeros(b, dtype=torch.long, device=self.device)
        positions, new_real, counts = self._place(q, real)
        self.cache.begin(q, positions, new_real, counts)
        try:
            return forward(self.model, self.cache, ids, positions, self._mask(b), keep_all)
        finally:
            self.cache.end()

    def _place(self, q: int, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """The positions (b, q), which are real (None: all) and how many per row of the next ``q``
        tokens of each row (what ``KVCache.begin`` takes), ``real`` (b, q) on the CPU marking
        those that are not padding (None: all are); the rows move past them."""
        b = self.rows
        if real is None or bool(real.all()):
            counts, new_real = [q] * b, None
            positions = self.next_position[:, None] + torch.arange(q, device=self.device)
        else:
            counts = real.sum(-1).tolist()  # a CPU tensor: no device read
            new_real = real.to(self.device)
            positions = self.next_position[:, None] + (new_real.cumsum(-1) - 1).clamp(min=0)
        self.next_position = self.next_position + torch.tensor(counts, device=self.device)
        return positions, new_real, counts

    def _mask(self, b: int) -> torch.Tensor:
        """A 4-D mask for the model, so that transformers builds none (infinikv's attention builds its own)."""
        if b not in self._all_real:
            self._all_real[b] = torch.ones(b, 1, 1, 1, dtype=torch.bool, device=self.device)
        return self._all_real[b]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: token ``tokens[r]`` (b,) for each row. Returns next-token logits (b, V)."""
        if not self.compile:
            return self.feed(tokens[:, None])
        if self._static is None:  # fresh, contiguous tensors: a compiled step's guards check strides
            self._static = (
                torch.empty(self.rows, 1, dtype=torch.long, device=self.device),
                torch.empty(self.rows, 1, dtype=torch.long, device=self.device),
                self._mask(self.rows),
            )
        ids, positions, mask = self._static
        ids.copy_(tokens[:, None])
        positions.copy_(self.next_position[:, None])
        self.next_position = self.next_position + 1
        self.cache.begin(1, positions, None, [1] * self.rows)
        try:
            args = (self.model, self.cache, ids, positions, mask)
            shape = self.cache.signature()  # what the host planned: a new plan may need another compiled step
            if self.compiled is None or shape != self._signature:
                started = time.perf_counter()
                self.compiled, self._signature = compiled.step_for(self.model, self.policy, args), shape
                self.compile_seconds = (self.compile_seconds or 0.0) + time.perf_counter() - started
            logits = self.compiled(*args)
        finally:
            self.cache.end()
        return logits.clone()

    # -- rows (the server's continuous batching) ----------------------------------------------
    def append(self, other: Batch) -> None:
        """Take ``other``'s rows (same policy) after this batch's rows."""
        join(self.cache, other.cache)
        self.next_position = torch.cat([self.next_position, other.next_position])
        self._static = self.compiled = None  # the compiled step's inputs change shape

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order)."""
        keep(self.cache, rows)
        self.next_position = self.next_position[torch.tensor(rows, dtype=torch.long, device=self.device)]
        self._static = self.compiled = None


@torch.inference_mode()
def step_together(batches: list[Batch], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """One decode step of several batches in one forward of their (shared) model: the dense parts
    run over every row at once, attention per batch. Returns each batch's logits (b_i, V)."""
    if len(batches) == 1:
        return [batches[0].step(tokens[0])]
    model = batches[0].model
    ids = torch.cat(tokens)[:, None]
    positions = torch.cat([b.next_position for b in batches])[:, None]
    for batch, rows in zip(batches, row_slices([b.rows for b in batches]), strict=True):
        batch.cache.begin(1, positions[rows], None, [1] * batch.rows)
        batch.next_position = batch.next_position + 1
    mask, cache = batches[0]._mask(ids.shape[0]), GroupedCache([b.cache for b in batches])
    try:
        logits = forward(model, cache, ids, positions, mask)
    finally:
        for batch in batches:
            batch.cache.end()
    return [logits[rows] for rows in row_slices([b.rows for b in batches])]


STOP_CHECK_EVERY = 8  # steps between two reads of "has every row stopped?" when nothing streams


@torch.inference_mode()
def sample(
    batch: Batch,
    logits: torch.Tensor,
    sampling: Sampling,
    stop_ids: Sequence[int],
    pad_id: int,
    on_tokens: Callable[[list[int], list[bool]], None] | None = None,
) -> list[list[int]]:
    """Generate from each row's next-token ``logits`` (b, V) until it emits a stop id or reaches
    ``sampling.max_new_tokens``. ``on_tokens(tokens, alive)`` gets each step's tokens (a row
    already stopped is not ``alive``). Returns each row's tokens, its stop id excluded."""
    device = batch.device
    generator = sampling.generator(device)
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], device=device)
    b = logits.shape[0]
    generated = torch.full((b, sampling.max_new_tokens), pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    steps = 0
    for step in range(sampling.max_new_tokens):
        token = torch.where(finished, pad_id, next_tokens(logits, sampling, generator))
        generated[:, step] = token
        was_finished = finished
        finished = finished | torch.isin(token, stops)
        steps = step + 1
        if on_tokens is not None:
            alive = (~was_finished & ~torch.isin(token, stops)).tolist()
            on_tokens(token.tolist(), alive)
            if not any(alive):
                break
        elif steps % STOP_CHECK_EVERY == 0 and bool(finished.all()):
            break
        if steps == sampling.max_new_tokens:
            break
        logits = batch.step(token)
    return [until_stop(row, stop_ids) for row in generated[:, :steps].tolist()]
