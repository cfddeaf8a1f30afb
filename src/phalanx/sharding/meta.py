"""A model built on the meta device: told apart from a real one, and given its values once sharded.

``px.wrap(model, opt, shard=px.FullyShard(...))`` takes a model built under ``with torch.device("meta"):``:
:mod:`phalanx.sharding.layout` lays it out with FSDP2, then each worker allocates its own shards and the model's own
``init_weights()`` / ``reset_parameters()`` (:func:`initialiser`) fills them, drawing from rank 0's random state
(:func:`_materialise`): no worker ever holds the whole model.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError, usage
from ..group.collectives import all_gather_object, broadcast_object, local_shard


def on_meta(model: nn.Module) -> bool:
    """True for a model built on the meta device (shapes and dtypes, no storage); refuses one that is partly there.

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(4, 2)
        >>> on_meta(net), on_meta(torch.nn.Linear(4, 2))
        (True, False)
    """
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [name for name, t in tensors if t.is_meta]
    if not meta or len(meta) == len(tensors):
        return bool(meta)
    real = next((name, t.device) for name, t in tensors if not t.is_meta)
    raise ConfigError(usage(f"a {type(model).__name__} partly on the meta device ({meta[0]!r} there, {real[0]!r} on "
                            f"{real[1]})", "a model built wholly on the meta device, or wholly on a real one",
                            'Build it all under `with torch.device("meta"):`, or none of it.'))


def initialiser(model: nn.Module) -> Callable[[], None]:
    """How a model built on the meta device fills its tensors once sharded: its own ``init_weights()`` or
    ``reset_parameters()``, else ``reset_parameters()`` of each submodule that has one (torch's layers do), in
    ``model.modules()`` order, as FSDP2 programs write it. Refuses, in one line, a module holding parameters or
    buffers that no ``reset_parameters()`` of its own or of an enclosing module covers.

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     net = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.LayerNorm(2))
        >>> initialiser(net).__name__   # each submodule's reset_parameters(), in model.modules() order
        'each'
    """
    for attr in ("init_weights", "reset_parameters"):
        own = getattr(model, attr, None)
        if callable(own):
            return own

    def bare(name: str, m: nn.Module, covered: bool) -> tuple[str, nn.Module] | None:
        covered = covered or callable(getattr(m, "reset_parameters", None))
        holds = any(t is not None for t in [*m._parameters.values(), *m._buffers.values()])
        if holds and not covered:
            return name, m
        return next((b for n, c in m.named_children()
                     if (b := bare(f"{name}.{n}" if name else n, c, covered)) is not None), None)

    missing = bare("", model, False)
    if missing is not None:
        name, m = missing
        cls = type(m).__name__
        held = ", ".join([*(n for n, t in m._parameters.items() if t is not None),
                          *(n for n, t in m._buffers.items() if t is not None)])
        raise ConfigError(usage(f"a {type(model).__name__} on the meta device whose module "
                                f"{name or '(the model itself)'!r} ({cls}) holds {held} and has no "
                                "reset_parameters()", "a method that fills every meta tensor in place once sharded: "
                                "reset_parameters() on each module holding parameters or buffers, or init_weights() "
                                "on the model", f"Add reset_parameters() to {cls} (torch.nn.init on its tensors), "
                                "or build the model on a real device."))
    modules = [m for m in model.modules() if callable(getattr(m, "reset_parameters", None))]

    def each() -> None:
        for m in modules:
            m.reset_parameters()

    return each


def _materialise(model: nn.Module, init: Callable[[], None], device: torch.device) -> None:
    """Storage for ``model``'s meta tensors on ``device`` (each worker its own shards), filled by ``init``.

    ``to_empty`` swaps each tensor's contents (``torch.__future__``'s swap on conversion, for this call only), so
    the Parameter objects stay: the optimizer's references and tied weights hold. ``init`` draws from rank 0's
    random state, as DTensor's own random ops do on CUDA: on workers seeded alike this is their own state (and
    it advances, as in torch's program); on workers seeded apart every replica still agrees, and each worker's own
    state comes back afterwards. On CPU DTensor's random ops draw each shard from that state alone (torch keeps
    offsets per shard on CUDA only), so the values equal torch's own CPU FSDP2 program's, not an unsharded build's.
    """
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    floats = [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()]
    with torch.no_grad():
        for _, t in floats:  # what init leaves untouched stays NaN, where to_empty would leave whatever was there
            local_shard(t).fill_(float("nan"))
    mine = torch.get_rng_state()
    theirs = broadcast_object(mine, 0, "rank 0's random state, to initialise the model built on the meta device")
    torch.set_rng_state(theirs)
    with torch.no_grad():
        init()
    if not torch.equal(mine, theirs):
        torch.set_rng_state(mine)
    left = next((name for name, t in floats if local_shard(t).isnan().any()), None)
    untouched = [n for n in all_gather_object(left, "what the model's initialisation left empty") if n is not None]
    if untouched:
        how = f"{init.__qualname__}()" if hasattr(init, "__self__") else "submodules' reset_parameters()"
        raise ConfigError(usage(f"a {type(model).__name__} on the meta device whose {how} left {untouched[0]!r} "
                                "unset", "an initialisation that sets every parameter and buffer (on the meta device "
                                "it is their only source of values)", "Make it also reset that tensor's module (e.g. "
                                "`for layer in self.layers: layer.reset_parameters()`), or build the model on a "
                                "real device."))


__all__ = ["initialiser", "on_meta"]
