"""Token Merging for Stable Diffusion on PyTorch and PaddlePaddle, from one implementation.

Importing this package imports neither torch nor paddle: it registers their tome_core backends,
each imported when a tensor of its framework first arrives. It makes `pipe.apply_tome()` /
`remove_tome()` on ppdiffusers objects run this implementation, whether ppdiffusers is imported
before or after it.
"""
from . import backends as _backends  # registers the torch and paddle backends with tome_core, lazily
from . import merge
from . import apply_tome as _ppdiffusers
from .hosts.targets import observe
from .config import ToDoConfig, ToMeConfig
from .patch import apply_patch, remove_patch
from .recommend import recommend

__version__ = "0.2.0"
__all__ = ["ToDoConfig", "ToMeConfig", "apply_patch", "merge", "observe", "recommend", "remove_patch"]

_ppdiffusers.install()
