"""infinikv: long-text LLM generation under a fixed KV-cache memory budget."""

from .attention import attach
from .engine import Generation, Sampling, generate
from .errors import InfinikvError
from .models import load_model
from .policies import KVCache, Policy, make_policy, policy_names

__all__ = [
    "Generation",
    "InfinikvError",
    "KVCache",
    "Policy",
    "Sampling",
    "attach",
    "generate",
    "load_model",
    "make_policy",
    "policy_names",
]
__version__ = "0.1.0"
