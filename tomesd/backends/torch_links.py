"""ToMe's hooks seated innermost in a torch module's forward chain.

torch's own forward hooks run in `Module.__call__`, outside whatever wraps `module.forward`: diffusers'
hook registry (its step caches FasterCache, TaylorSeer, Pyramid Attention Broadcast, its offloading and
layerwise casting) and accelerate's device hooks both replace `forward` with a chain that ends in the
module's own forward. A merge done in `__call__` would reach a cache as merged tokens, so the cache would
keep tokens in one step's matching order and replay them into another's. Seated where the chain calls the
module's own forward, the merge happens after every wrapper has decided to compute and the unmerge before
any of them sees the output: caches keep and replay full-token outputs, device hooks have moved the inputs.

The chain's links live in known places: `module.forward` (an instance attribute), accelerate's
`module._old_forward`, and the `forward` / `original_forward` references of diffusers' hook registry
(`module._diffusers_hook._fn_refs`). A link is seated in the place that holds the module's own bound
forward, and taken out from wherever it is found later (diffusers moves the inner reference of a removed
hook outward), so either side can be removed first.
"""
from __future__ import annotations

import inspect
from types import FunctionType, MethodType
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch


class InnerLink:
    """`pre(module, args, kwargs)`, the rest of the chain (`inner`), `post(module, args, output)`: the
    hook signatures of torch's forward hooks, so one hook object serves either place. Or, given `wrap`,
    `wrap(module, inner, args, kwargs)` in their place: it calls the rest of the chain itself, as often as it
    needs (restore_tokens in downsample mode runs it twice at a window's first step).

    What is seated in the chain is `forward`, the link's call as a bound method, not the link: dynamo guards a
    callable object met as a module's forward by identity, so blocks compiled on their own (diffusers'
    compile_repeated_blocks) would get a graph per block; a bound method is guarded by its function's code, one for
    every link. Its function is the link's own copy of `__call__`, whose `__signature__` is the rest of the chain's
    (inspect.signature(module.forward) reads the module's own). `post` may be set after seating (a block's exit:
    ToMePatch.regional_call)."""

    __slots__ = ("module", "pre", "post", "_inner", "owner", "wrap", "forward")

    def __init__(self, module: torch.nn.Module, pre: Optional[Callable], post: Optional[Callable], owner: Any,
                 inner: Callable, wrap: Optional[Callable] = None) -> None:
        self.module, self.pre, self.post, self.owner, self.wrap = module, pre, post, owner, wrap
        call = InnerLink.__call__
        own = FunctionType(call.__code__, call.__globals__, "__call__")
        own.link = self  # a copy's forward shares this function (deepcopy) or is the class's (pickle): not its own
        self.forward = MethodType(own, self)
        self.inner = inner

    @property
    def inner(self) -> Callable:
        return self._inner

    @inner.setter
    def inner(self, inner: Callable) -> None:
        self._inner = inner
        function = self.forward.__func__
        if function.__dict__.get("link") is not self:
            return  # a copy's: it keeps the signature it was made with
        try:  # the signature of the rest of the chain, behind the bound method's own first parameter
            signature = inspect.signature(inner)
        except (TypeError, ValueError):
            return
        first = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        function.__signature__ = signature.replace(parameters=[first, *signature.parameters.values()])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.wrap is not None:
            return self.wrap(self.module, self._inner, args, kwargs)
        if self.pre is not None:
            changed = self.pre(self.module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        output = self._inner(*args, **kwargs)
        if self.post is not None:
            changed = self.post(self.module, args, output)
            if changed is not None:
                output = changed
        return output


def link_of(value: Any) -> Optional[InnerLink]:
    """The link whose `forward` `value` is (or the link itself), or None (any other callable of a forward chain)."""
    if type(value) is MethodType:
        value = value.__self__
    return value if isinstance(value, InnerLink) else None


Slot = Tuple[Any, str]


def _slots(module: torch.nn.Module) -> Iterator[Slot]:
    """Every place that may reference a link of `module`'s forward chain."""
    own = module.__dict__
    if "forward" in own:
        yield module, "forward"
    if "_old_forward" in own:  # accelerate.hooks.add_hook_to_module
        yield module, "_old_forward"
    registry = own.get("_diffusers_hook")
    for ref in getattr(registry, "_fn_refs", ()):  # diffusers.hooks.HookRegistry
        yield ref, "forward"
        if getattr(ref, "original_forward", None) is not None:
            yield ref, "original_forward"
    # Links of ToMe itself (a second site on one module) reference the rest of the chain too.
    for holder, name in list(_link_slots(module)):
        yield holder, name


def _link_slots(module: torch.nn.Module) -> Iterator[Slot]:
    seen: List[int] = []
    stack = [module.__dict__.get("forward")]
    registry = module.__dict__.get("_diffusers_hook")
    stack += [getattr(ref, attr, None) for ref in getattr(registry, "_fn_refs", ())
              for attr in ("forward", "original_forward")]
    stack.append(module.__dict__.get("_old_forward"))
    while stack:
        link = link_of(stack.pop())
        if link is not None and id(link) not in seen:
            seen.append(id(link))
            yield link, "inner"
            stack.append(link.inner)


def _value(holder: Any, name: str) -> Any:
    return holder.__dict__.get(name) if isinstance(holder, torch.nn.Module) else getattr(holder, name, None)


def _is_own_forward(value: Any, module: torch.nn.Module) -> bool:
    return getattr(value, "__self__", None) is module and getattr(value, "__func__", None) is type(module).forward


def seat(module: torch.nn.Module, pre: Optional[Callable], post: Optional[Callable], owner: Any,
         wrap: Optional[Callable] = None) -> InnerLink:
    """A link of `owner` where `module`'s chain calls its own forward (see the module docstring)."""
    for holder, name in _slots(module):
        value = _value(holder, name)
        if _is_own_forward(value, module):
            link = InnerLink(module, pre, post, owner, value, wrap)
            setattr(holder, name, link.forward)
            return link
    # No wrapper holds the own forward: the class's forward is called directly (or an unknown wrapper
    # replaced it, and the link goes outside that wrapper, where torch's hooks would be).
    link = InnerLink(module, pre, post, owner, module.forward, wrap)
    module.forward = link.forward
    return link


def owners(module: torch.nn.Module) -> List[Any]:
    """The owners of the links in `module`'s chain."""
    return [holder.owner for holder, _ in _link_slots(module)]


def unseat(module: torch.nn.Module, owns: Callable[[Any], bool]) -> None:
    """Take every link whose owner `owns` accepts out of `module`'s chain, wherever the chain's owners
    moved it."""
    changed = True
    while changed:
        changed = False
        for holder, name in list(_slots(module)):
            link = link_of(_value(holder, name))
            if link is not None and owns(link.owner):
                if holder is module and name == "forward" and _is_own_forward(link.inner, module):
                    del module.__dict__["forward"]  # the module as it was: its class's forward
                else:
                    setattr(holder, name, link.inner)
                changed = True
                break
