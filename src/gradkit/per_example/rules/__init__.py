"""Per-layer rules. Importing this package registers them."""

from gradkit.per_example.rules import _conv, _embedding, _embedding_bag, _linear, _norm
from gradkit.per_example.rules._fallback import vmap_rule

__all__ = ["vmap_rule"]
del _conv, _embedding, _embedding_bag, _linear, _norm
