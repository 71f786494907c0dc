"""infinikv: long-text LLM generation under a fixed KV-cache memory budget."""

from .attention import attach
from .core import Batch, Sampling
from .engine import Generation, generate
from .errors import InfinikvError
from .models import load_model
from .policies import KVCache, Policy, make_policy, parse_spec, policy_names
from .preparation import ensure_prepared

__all__ = [
    "Batch",
    "Generation",
    "InfinikvError",
    "KVCache",
    "Policy",
    "Sampling",
    "attach",
    "ensure_prepared",
    "generate",
    "load_model",
    "make_policy",
    "parse_spec",
    "policy_names",
]
__version__ = "0.1.0"
