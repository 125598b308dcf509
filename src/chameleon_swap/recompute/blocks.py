"""Finding a model's repeated blocks (the units the recompute mechanism runs keep, selective or
full, and weight offload moves): Hugging Face ``_no_split_modules``, else the largest
nn.ModuleList of one class, or what the user names; and checking that no two of them share
parameters."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

_BLOCKS_HELP = ("blocks must be None (Hugging Face _no_split_modules, else the largest nn.ModuleList "
                "of one class), a dotted path to an nn.ModuleList such as 'model.layers', or a "
                "list of submodules")


def find_blocks(model: nn.Module, blocks=None) -> list[nn.Module]:
    """The model's repeated blocks, in module order.

    ``blocks=None``: modules whose class is named in a Hugging Face ``_no_split_modules`` (of the
    model or any submodule; outermost matches only, in ``named_modules`` order); if there is none,
    the children of the nn.ModuleList of one class holding the most parameters (then the longest;
    ties: the first found). ``blocks`` may also be a dotted path to an nn.ModuleList
    (``"model.layers"``), or a list, tuple or nn.ModuleList of submodules of ``model`` (distinct,
    none inside another).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    if blocks is None:
        found = _no_split_blocks(model) or _largest_uniform_list(model)
        if not found:
            raise ValueError(f"blocks=None found no blocks in {type(model).__name__}: it has no "
                             f"_no_split_modules match and no non-empty nn.ModuleList of one "
                             f"class; {_BLOCKS_HELP}")
        return found
    if isinstance(blocks, str):
        try:
            holder = model.get_submodule(blocks)
        except AttributeError as e:
            raise ValueError(f"blocks={blocks!r} names no submodule of {type(model).__name__} "
                             f"({e}); {_BLOCKS_HELP}") from None
        if not isinstance(holder, nn.ModuleList):
            raise ValueError(f"blocks={blocks!r} is a {type(holder).__name__}, not an "
                             f"nn.ModuleList; {_BLOCKS_HELP}")
        found = list(holder)
    elif isinstance(blocks, (list, tuple, nn.ModuleList)):
        found = list(blocks)
        for b in found:
            if not isinstance(b, nn.Module):
                raise TypeError(f"blocks must hold nn.Module objects; got a {type(b).__name__}")
        inside = {id(m) for m in model.modules()}
        for b in found:
            if id(b) not in inside:
                raise ValueError(f"blocks holds a {type(b).__name__} that is not a submodule of "
                                 f"{type(model).__name__}; {_BLOCKS_HELP}")
    else:
        raise TypeError(f"{_BLOCKS_HELP}; got {type(blocks).__name__}")
    if not found:
        raise ValueError(f"blocks={blocks!r} holds no modules; {_BLOCKS_HELP}")
    _check_disjoint(found)
    return found


def _no_split_blocks(model: nn.Module) -> list[nn.Module]:
    names: set[str] = set()
    for m in model.modules():
        value = getattr(m, "_no_split_modules", None)
        if isinstance(value, (list, tuple, set, frozenset)):
            names.update(v for v in value if isinstance(v, str))
    if not names:
        return []
    found, prefixes = [], []
    for name, m in model.named_modules():
        if name and type(m).__name__ in names and not any(name.startswith(p) for p in prefixes):
            found.append(m)
            prefixes.append(name + ".")
    return found


def _largest_uniform_list(model: nn.Module) -> list[nn.Module]:
    best, best_key = [], None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1:
            key = (sum(p.numel() for p in m.parameters()), len(m))
            if best_key is None or key > best_key:
                best, best_key = list(m), key
    return best


def _check_disjoint(found: list[nn.Module]) -> None:
    ids = [id(b) for b in found]
    if len(set(ids)) != len(ids):
        raise ValueError("blocks lists one module twice; each block must appear once")
    for b in found:
        inner = {id(m) for m in b.modules() if m is not b}
        for other in found:
            if id(other) in inner:
                raise ValueError(f"blocks must not nest: a {type(other).__name__} is inside a "
                                 f"{type(b).__name__}; pass the outermost blocks only")


def check_unshared(blocks: list[nn.Module], model: Optional[nn.Module] = None) -> None:
    """Refuse a parameter storage held by two of ``blocks``, or by a block and the rest of
    ``model`` (tied weights): whatever moves or frees one block's weights would pull them from
    under the other user."""
    owner: dict = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            other = owner.setdefault(id(p.untyped_storage()), (i, p))[0]
            if other != i:
                raise ValueError(f"blocks {other} and {i} share a parameter (tied weights): "
                                 "weight offload needs each block's parameters to be its own; "
                                 "untie them or leave those blocks out of blocks")
    if model is None:
        return
    inside = {id(m) for b in blocks for m in b.modules()}
    for name, m in model.named_modules():
        if id(m) in inside:
            continue
        own = list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
        for pname, t in own:
            if t is not None and id(t.untyped_storage()) in owner:
                full = f"{name}.{pname}" if name else pname
                raise ValueError(f"model.{full} shares its storage with a parameter of block "
                                 f"{owner[id(t.untyped_storage())][0]} (tied weights): weight "
                                 "offload would release it under the rest of the model; untie "
                                 "it or leave that block out")
