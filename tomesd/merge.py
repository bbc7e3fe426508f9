"""tomesd 0.1.3's `tomesd.merge` names, served by the shared core."""
from tome_core import bipartite_soft_matching_random2d, do_nothing

__all__ = ["bipartite_soft_matching_random2d", "do_nothing"]
