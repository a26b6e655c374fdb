"""What the module hooks of the module and op levels share: the tensors in a module's arguments or
output, a cheap gradient hook, and running a hook eagerly inside ``torch.compile``'d code."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

__all__ = ["COMPILED", "grad_hook", "is_compiled_wrapper", "leaves", "module_paths", "outside_compile"]


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's arguments or output (a tensor or a flat tuple without the pytree walk)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return [v for v in value if v is not None]
    out = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif is_dataclass(leaf) and not isinstance(leaf, type):  # a model output class pytree does not know
            out.extend(leaves([getattr(leaf, f.name) for f in fields(leaf)]))
    return out


def grad_hook(t: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``t.register_hook(hook)`` without the handle that could remove it (the hook lives as long as
    ``t``): the same steps at a third of the cost, for hundreds of module outputs per step. A
    tensor that the public call would handle otherwise (a leaf, a subclass or an active torch function
    mode) gets the public call."""
    fn = t.grad_fn
    if fn is None or torch._C._has_torch_function_unary(t):
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        t._backward_hooks = hooks = collections.OrderedDict()
        fn._register_hook_dict(t)
    key = RemovableHandle.next_id  # the ids handles take: no hook registered either way is replaced
    RemovableHandle.next_id += 1
    hooks[key] = hook


COMPILED = "_orig_mod"  # the attribute under which torch.compile's OptimizedModule holds the module it wraps


def is_compiled_wrapper(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, COMPILED, None), torch.nn.Module) and type(module).__name__ == "OptimizedModule"


def _eager_call(hook: Callable, *args: Any) -> Any:
    return hook(*args)


_eager: list[Callable] = []  # torch.compiler.disable(_eager_call), made when compiled code first calls a hook


def outside_compile(hook: Callable) -> Callable:
    """``hook``, run eagerly even where ``torch.compile`` traces the module: Dynamo would otherwise trace
    the recorder's Python into its graph with fake tensors (recording nothing real, or failing on it).
    There the call breaks the graph and runs on the real tensors, so a compiled model at module or op
    level runs in pieces split at its modules. In eager code the guard costs one flag test, and Dynamo
    (a second to import) is not loaded for it."""
    is_compiling = torch.compiler.is_compiling

    def run(*args: Any) -> Any:
        if is_compiling():
            if not _eager:
                _eager.append(torch.compiler.disable(_eager_call))
            return _eager[0](hook, *args)
        return hook(*args)

    return run


def module_paths(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules to hook, by path: a ``torch.compile``'d module (an ``OptimizedModule``) is the module
    it wraps, under the uncompiled model's paths (no ``_orig_mod``); the wrapper itself is left out (it
    would record the root twice)."""
    out = []
    for path, module in model.named_modules():
        if is_compiled_wrapper(module):
            continue
        if COMPILED in path:
            path = ".".join(part for part in path.split(".") if part != COMPILED)
        out.append((path, module))
    return out
