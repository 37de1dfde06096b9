"""One decision for every rank: rank 0 computes a value, the other ranks receive it.

Under ``torch.distributed`` each rank tuning on its own could pick different kernels for the same
site (timings are noisy), and ranks running different kernels compute slightly different
numbers. :func:`agree` makes the choice once::

    >>> choice = agree(lambda: tune(site))      # rank 0 tunes; every rank returns rank 0's choice

Design:

* Outside distributed runs (``torch.distributed`` not built, no process group initialised, or a
  group of one) ``agree`` is just ``compute()``.
* Otherwise rank 0 of the group calls ``compute()``, pickles the result and broadcasts
  ``("ok", bytes)`` with ``broadcast_object_list``; the other ranks never call ``compute``.
* If rank 0's ``compute()`` (or pickling its result) raises, rank 0 broadcasts ``("error", text)``
  and re-raises its own exception; the other ranks raise a ``RuntimeError`` carrying rank 0's
  error text and traceback. No rank is left waiting in the collective.
* Every rank of the group must call ``agree`` the same number of times, in the same order (it is
  a collective). For NCCL groups, set the rank's CUDA device (``torch.cuda.set_device``) first,
  as for any object collective.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["agree"]

T = TypeVar("T")


def _group_size(group: Any) -> int:
    """World size of ``group`` when a distributed run is active, else 1."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def agree(compute: Callable[[], T], *, group: Any = None) -> T:
    """``compute()`` on rank 0 of ``group`` (default: the whole world), its result on every rank.

    Args:
        compute: called with no arguments on rank 0 only; its result must be picklable.
        group: a ``torch.distributed`` process group, or ``None`` for the default group.

    Raises:
        RuntimeError: on ranks other than 0 when rank 0's ``compute()`` raised (the message
            carries rank 0's error); rank 0 re-raises its own exception.
        ValueError: when this process is not a member of ``group``.
    """
    if _group_size(group) == 1:
        return compute()
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("agree() was called on a rank that is not in the given process group; "
                         "call it only on the group's members, or pass group=None for all ranks")
    src = 0 if group is None else dist.get_global_rank(group, 0)
    if rank != 0:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=src, group=group)
        status, payload = message[0]
        if status == "error":
            raise RuntimeError(f"rank 0 failed to compute the value all ranks agree on: {payload}")
        return pickle.loads(payload)
    try:
        value = compute()
        payload = pickle.dumps(value)
    except BaseException as e:  # also KeyboardInterrupt: the other ranks must not wait forever
        text = f"{type(e).__name__}: {e}\n\nRank 0's traceback:\n{traceback.format_exc()}"
        dist.broadcast_object_list([("error", text)], src=src, group=group)
        raise
    dist.broadcast_object_list([("ok", payload)], src=src, group=group)
    return value
