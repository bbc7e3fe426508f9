"""torch's seams (torch_dispatch.py, torch_sdpa.py) on the shared base (seam.py): armed slots kept as a plain
attribute while torch.compile traces, since thread-locals break its graphs."""
from __future__ import annotations

import torch

from .seam import Seam as _Seam


class Seam(_Seam):
    def _compiling(self) -> bool:
        return torch.compiler.is_compiling()
