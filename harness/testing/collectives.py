"""Counting the collectives a piece of code issues, for tests and benchmarks of sharded code.

    with CollectiveCounter() as counter:
        list(merged_named_parameters(model))
    counter.count, counter.names   # e.g. 3, ['c10d.gather_.default', ...]

A `TorchDispatchMode` that sees every operator of the c10d namespaces (`torch.distributed`'s collectives, as
`dist.gather` and `dist.all_gather_into_tensor` dispatch them, and the functional collectives a DTensor's
`full_tensor()` and redistributions use), on the thread that issues them. Waits and autograd wrappers are not
collectives and are not counted.
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


class CollectiveCounter(TorchDispatchMode):
    """The collectives issued while it is entered: `names` in order, `count` of them."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    @property
    def count(self) -> int:
        return len(self.names)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in _NAMESPACES and not any(part in func.name() for part in _NOT_COLLECTIVES):
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


__all__ = ["CollectiveCounter"]
