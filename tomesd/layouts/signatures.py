"""Where an input of a host module's forward arrives: by position or by keyword, read from its signature
once at apply time, so the per-call path only indexes `args` or looks up `kwargs`."""
from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence, Tuple

# The names hosts give the inputs ToMe reads.
TOKENS = ("hidden_states", "x")
LATENT = ("sample", "x")
TIMESTEP = ("timestep", "timesteps", "t")
CONTEXT = ("encoder_hidden_states", "context")
MASK = ("attention_mask",)


def _parameters(module: Any) -> list:
    """The parameters of the module class's own forward: callers pass what it declares. (An instance's
    `forward` may be another library's wrapper taking `self, *args, **kwargs`, as cache-dit's is, or a
    chain of hooks.)"""
    own = getattr(type(module), "forward", None)
    try:
        if inspect.isfunction(own):
            return list(inspect.signature(own).parameters.values())[1:]
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


class InputSpec:
    """Where one input of a module's forward arrives: by position `index`, or by keyword `name`."""

    __slots__ = ("name", "index")

    def __init__(self, name: str, index: Optional[int]):
        self.name, self.index = name, index

    @classmethod
    def find(cls, module: Any, names: Sequence[str], first_positional: bool) -> Optional["InputSpec"]:
        """The first of `names` in the module's forward signature (else its first positional
        parameter, when `first_positional`), or None."""
        params = _parameters(module)
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keyword = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
        for name in names:
            if name in positional:
                return cls(name, positional.index(name))
            if name in keyword:
                return cls(name, None)
        if first_positional:
            return cls(positional[0], 0) if positional else cls(names[0], 0)
        return None

    def get(self, args: tuple, kwargs: dict) -> Any:
        if self.index is not None and len(args) > self.index:
            return args[self.index]
        return kwargs.get(self.name)

    def replace(self, args: tuple, kwargs: dict, value: Any) -> Tuple[tuple, dict]:
        i = self.index
        if i is not None and len(args) > i:
            return args[:i] + (value,) + args[i + 1:], kwargs
        return args, {**kwargs, self.name: value}
