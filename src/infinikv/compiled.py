"""The compiled decode step: traced and compiled once per machine, then loaded from disk in seconds.

``torch.compile`` of infinikv's decode (the model's forward over a cache whose shapes are fixed)
spends ~50 s in a fresh process, and ~15 s even when inductor's own caches hit, because dynamo
traces the Python of 30 layers again (measured: 10 of those 15 s are bytecode tracing). So the
step is compiled ahead of time (``aot_compile``: the traced bytecode, its guards and inductor's
code, serialized) and saved under ``$INFINIKV_HOME/compiled/<key>-<variant>.pt``; another process loads it
without tracing (~3 s). The key covers what the traced code depends on: the source of infinikv,
torch and transformers, the native kernels' build (and so the CPU), the model's config, weights
format and dtype, the policy (less its size) and the batch's rows. The slots' dimension is traced
as dynamic, so one artifact serves every capacity and context length.

A batch checks a step's guards on its first call, and again only when the host plans something
else (``KVCache.signature``: e.g. ``bct`` starting to renumber its keys); in between the guards
are skipped (checking a whole model's guards costs milliseconds a step). A key may hold several
variants, one per plan seen; inputs that fit none get a new one, compiled and saved. An entry
that fails to load (truncated, corrupt, another torch) is removed and compiled again with a
warning, never an error. CUDA keeps torch.compile's own CUDA-graph mode, compiled in each process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import threading
import time
import types
import uuid
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from . import native
from .errors import InfinikvError
from .forward import forward
from .paths import home
from .policies import Policy
from .sizes import model_device
from .weights import weights_format

SIZE_OPTIONS = ("budget", "capacity", "kv_memory")  # shape the slots only: not part of the key


def decode(model: torch.nn.Module, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
    """One decode step's forward (what is compiled): next-token logits (b, V)."""
    return forward(model, cache, ids, positions, mask)


@functools.cache
def source_digest() -> str:
    """infinikv's own Python and C++ source, and the versions of what it traces through."""
    import transformers

    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    root = Path(__file__).parent
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def step_key(model: torch.nn.Module, policy: Policy, rows: int) -> str:
    """What a compiled step depends on (see the module docstring), as a short hex digest."""
    spec = {k: v for k, v in policy.spec().items() if k not in SIZE_OPTIONS}
    device = model_device(model)
    parts = {
        "source": source_digest(),
        "native": native.build_key() if native.ready else None,
        "model": model.config.to_json_string(use_diff=False),
        "weights": weights_format(model),
        "dtype": str(next(model.parameters()).dtype),
        "device": device.type,
        "policy": spec,
        "rows": rows,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def compiled_dir() -> Path:
    return home() / "compiled"


MODES = ("auto", "on", "off")  # what --compile takes


def variants(key: str) -> list[Path]:
    """The compiled steps saved under ``key``, the most recently written first."""
    found = list(compiled_dir().glob(f"{key}-*.pt")) if compiled_dir().is_dir() else []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def built(model: torch.nn.Module, policy: Policy, rows: int = 1) -> bool:
    """Whether a compiled step for ``policy`` on ``model`` with ``rows`` rows is ready (in this
    process or on disk)."""
    key = step_key(model, policy, rows)
    return bool(_LOADED.get(key)) or bool(variants(key))


def resolve(
    mode: bool | str, model: torch.nn.Module, policy: Policy, rows: int = 1, max_length: int | None = None
) -> bool:
    """Whether a batch decodes compiled. ``on`` (True) and ``off`` (False) say so; ``auto``
    compiles where it pays without a wait: the policy's shapes can be fixed (``full`` given
    ``max_length``), the device is a CPU or a GPU, and on a CPU its step is already built (by
    ``infinikv prepare --compile`` or an earlier run), which loads in seconds."""
    if mode in (True, "on"):
        return True
    if mode in (False, "off"):
        return False
    if mode != "auto":
        raise InfinikvError(f"--compile takes {', '.join(MODES)}, got {mode!r}")
    device = model_device(model).type
    if device not in ("cpu", "cuda") or not policy.compilable:
        return False
    try:
        policy.static_size(model, max_length)
    except InfinikvError:  # full without a length to size its storage
        return False
    return device == "cuda" or built(model, policy, rows)


class Step:
    """A compiled decode step: ``step(model, cache, ids, positions, mask) -> logits`` (see the
    module docstring)."""

    def __init__(self, function: Callable, path: Path | None = None) -> None:
        self.function, self.path = function, path

    def checks(self, *args) -> bool:
        """Whether the step was traced for inputs like these (its guards)."""
        return bool(self.function.guard_check(*args))

    def __call__(self, *args) -> torch.Tensor:
        return self.function(*args)


_LOADED: dict[str, list[Step]] = {}  # by key: the variants loaded or built in this process


def _serializable_guards(entries) -> list[bool]:
    """Keep the guards that can be saved: the tensors' shapes, strides and dtypes, the cache's
    plain attributes; drop those on globals and identities (they do not survive a process)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in unsaved or unsaved & set(e.derived_guard_types)) for e in entries]


def _mark_slots_dynamic(cache) -> None:
    for layer in cache.layers:
        for tensor in layer.slots.tensors():
            torch._dynamo.mark_dynamic(tensor, 2)


@contextmanager
def progress_line(what: str):
    """``what ... N s`` on stderr while a long call runs (updated in place on a terminal)."""
    started, done = time.perf_counter(), threading.Event()
    stream = sys.stderr
    live = stream.isatty()
    print(f"infinikv: {what} ...", end="" if live else "\n", file=stream, flush=True)

    def tick() -> None:
        while not done.wait(1.0):
            print(f"\rinfinikv: {what} ... {time.perf_counter() - started:.0f} s", end="", file=stream, flush=True)

    ticker = threading.Thread(target=tick, daemon=True) if live else None
    if ticker:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if ticker:
            ticker.join()
        print(f"{chr(13) if live else ''}infinikv: {what}: {time.perf_counter() - started:.1f} s", file=stream)


def _build(policy: Policy, args: tuple, path: Path) -> Step:
    _mark_slots_dynamic(args[1])
    with progress_line(f"compiling the decode step of {policy.label()} (once per machine; kept in {path.parent})"):
        for attempt in range(4):  # dynamo restarts its analysis when it must specialize a float
            try:
                compiler = torch.compile(decode, fullgraph=True, options={"guard_filter_fn": _serializable_guards})
                function = compiler.aot_compile((args, {}))
                break
            except torch._dynamo.exc.RestartAnalysis:
                if attempt == 3:
                    raise
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        function.save_compiled_function(str(path))
    except Exception as exc:  # a step that cannot be saved still runs in this process
        warnings.warn(
            f"infinikv: the compiled step could not be saved ({str(exc).splitlines()[0][:200]})", stacklevel=3
        )
    function.disable_guard_check()
    return Step(function, path)


def _load(path: Path) -> Step | None:
    try:
        with path.open("rb") as file:
            function = torch.compiler.load_compiled_function(file)
    except FileNotFoundError:
        return None
    except Exception as exc:  # truncated, corrupt, or written by another torch: removed, compiled again
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        warnings.warn(f"infinikv: compiled step {path} unusable ({reason}); compiling again", stacklevel=4)
        path.unlink(missing_ok=True)
        return None
    function.disable_guard_check()
    return Step(function)


def step_for(model: torch.nn.Module, policy: Policy, args: tuple) -> Callable:
    """The compiled step for ``args`` (model, cache, ids, positions, mask): one whose guards these
    inputs pass, from this process, from disk, or compiled now and saved. A key may hold several
    variants, one per plan its steps took (``bct`` past the trained context renumbers keys: a
    second one)."""
    if args[2].device.type == "cuda":  # CUDA graphs replay fixed addresses: the storage never moves
        for layer in args[1].layers:
            for t in layer.slots.tensors():
                torch._dynamo.mark_static_address(t)
        return _cuda_step(model)
    key = step_key(model, policy, args[2].shape[0])
    loaded = _LOADED.setdefault(key, [])
    for step in loaded:
        if step.checks(*args):
            return step
    seen = {step.path for step in loaded}
    for path in variants(key):
        if path not in seen and (step := _load(path)) is not None:
            step.path = path
            loaded.append(step)
            if step.checks(*args):
                return step
    step = _build(policy, args, compiled_dir() / f"{key}-{uuid.uuid4().hex[:8]}.pt")
    loaded.append(step)
    return step


_CUDA: weakref.WeakKeyDictionary[torch.nn.Module, Callable] = weakref.WeakKeyDictionary()


def _cuda_step(model: torch.nn.Module) -> Callable:
    """On a GPU: torch.compile with CUDA graphs, in this process (a copy of ``decode``'s code per
    model, so that dynamo keeps each model's graphs apart and can skip the guards on its modules)."""
    if model not in _CUDA:
        code = decode.__code__.replace(co_name=f"decode_{len(_CUDA)}_{id(model):x}")
        own = types.FunctionType(code, decode.__globals__, code.co_name)
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        _CUDA[model] = torch.compile(own, mode="reduce-overhead", options=options)
    return _CUDA[model]
