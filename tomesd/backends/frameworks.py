"""Which framework an object belongs to, told without importing either framework."""
from __future__ import annotations

import importlib
import sys
from typing import Any, Optional

# (framework, module of the base class, base class name)
_MODULE_BASES = (("torch", "torch.nn.modules.module", "Module"), ("paddle", "paddle.nn.layer.layers", "Layer"))


def framework_of(obj: Any) -> Optional[str]:
    """'torch' or 'paddle' when `obj` is a module of that framework, else None."""
    for cls in type(obj).__mro__:
        for name, module, base in _MODULE_BASES:
            if cls.__name__ == base and cls.__module__ == module:
                return name
    return None


def host_ops(framework: str) -> Any:
    """`framework`'s host ops: module hooks, graph-compiler detection, grad mode (tomesd.backends.<framework>)."""
    if framework not in sys.modules:
        raise TypeError(f"{framework} is not imported, so this cannot be a {framework} model")
    return importlib.import_module(f"tomesd.backends.{framework}").host


def array_ops(framework: str) -> Any:
    """`framework`'s array namespace, as tome_core finds it for that framework's tensors."""
    from tome_core.backend import backend_for_name

    return backend_for_name(framework)


def class_names(obj: Any) -> set:
    """Names of every class in obj's ancestry: lets us recognise host classes without importing them."""
    return {cls.__name__ for cls in type(obj).__mro__}
