"""Nested state (``state_dict()`` trees) as JSON plus named tensors, and its exact digest.

A ``state_dict()`` mixes tensors with ints, floats, tuples, ``None`` and int-keyed dicts (an
optimizer's). ``flatten`` turns it into a JSON-able tree, where tensors become references into a flat
``{name: tensor}`` map (stored in safetensors), and ``unflatten`` rebuilds it exactly: floats travel as
``float.hex`` so no bit is lost, tuples stay tuples, int keys stay ints. No pickle is involved.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch

_TENSOR, _TUPLE, _DICT, _FLOAT = "__tensor__", "__tuple__", "__dict__", "__float__"


def flatten(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replaces every tensor in ``tree`` by a reference named under ``prefix``; returns the JSON tree."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree.detach() if tree.requires_grad else tree  # detach() costs a microsecond a tensor
        return {_TENSOR: prefix}
    if isinstance(tree, bool) or tree is None or isinstance(tree, (int, str)):
        return tree
    if isinstance(tree, float):
        return {_FLOAT: tree.hex()}
    if isinstance(tree, tuple):
        return {_TUPLE: [flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(tree)]
    if isinstance(tree, dict):
        if all(isinstance(k, str) for k in tree) and not ({_TENSOR, _TUPLE, _DICT, _FLOAT} & tree.keys()):
            return {k: flatten(v, f"{prefix}.{k}", tensors) for k, v in tree.items()}
        for k in tree:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise ValueError(f"state key {k!r} under {prefix!r} is not a str or int; cannot store it")
        return {_DICT: [[k, flatten(v, f"{prefix}.{k}", tensors)] for k, v in tree.items()]}
    raise ValueError(
        f"state entry {prefix!r} has type {type(tree).__name__}, which samestep stores without pickle "
        "only as tensors, numbers, strings, None, lists, tuples and dicts; convert it in state_dict()"
    )


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``flatten``."""
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if _TENSOR in tree:
            return tensors[tree[_TENSOR]]
        if _FLOAT in tree:
            return float.fromhex(tree[_FLOAT])
        if _TUPLE in tree:
            return tuple(unflatten(v, tensors) for v in tree[_TUPLE])
        if _DICT in tree:
            return {k: unflatten(v, tensors) for k, v in tree[_DICT]}
        return {k: unflatten(v, tensors) for k, v in tree.items()}
    return tree


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's buffers that are part of its ``state_dict``, by name, each tensor once (a trace records
    them, a receipt copies them at the step's end)."""
    out, seen = [], set()
    for prefix, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append((f"{prefix}.{name}" if prefix else name, b))
    return out


def canonical_json(obj: Any) -> bytes:
    """Key-sorted, compact JSON bytes: the form that digests are taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, in row-major order (a view: no copy for CPU tensors)."""
    try:  # a contiguous CPU tensor of a NumPy dtype, not requiring grad: its memory in two calls
        return memoryview(t.numpy()).cast("B")
    except (TypeError, RuntimeError):  # another device or dtype, grad, conj bit, strided, empty: the general path
        pass
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@functools.lru_cache(maxsize=4096)
def tensor_header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """What a tensor's hash takes before its bytes (docs/formats.md): its dtype and shape. Made once per dtype
    and shape: formatting them costs more than hashing a small tensor."""
    return f"{dtype}|{shape}|".encode()


def sha256_tensor(t: torch.Tensor) -> str:
    """SHA-256 over a tensor's dtype, shape and bytes."""
    h = hashlib.sha256(tensor_header(t.dtype, tuple(t.shape)))
    h.update(tensor_bytes(t))
    return h.hexdigest()


def tree_digest(
    tree: Any, tensor_digests: Callable[[list[torch.Tensor]], list[str]], new_hash: Callable[[bytes], Any]
) -> str:
    """A state tree's digest (docs/formats.md): ``new_hash`` over its canonical JSON skeleton, then each
    tensor's name, a zero byte and its hex digest by ``tensor_digests`` (all the tree's tensors in one call),
    in name order."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(tree, "state", tensors)
    each = dict(zip(tensors, tensor_digests(list(tensors.values()))))
    h = new_hash(canonical_json(skeleton))
    for name in sorted(each):
        h.update(name.encode() + b"\0" + each[name].encode())
    return h.hexdigest()


def state_digest(tree: Any) -> str:
    """SHA-256 over a state tree: its JSON structure and every tensor's dtype, shape and bytes."""
    return tree_digest(tree, lambda tensors: [sha256_tensor(t) for t in tensors], hashlib.sha256)


def dotted(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict (a config) as one level with dotted keys: {"train": {"lr": 1}} -> {"train.lr": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
