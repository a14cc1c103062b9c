"""The algorithm's state across updates (rloo.AlgorithmState) held to its one rule: it changes in one method, called
once per update after training, so that a stop or a fault during an update, and a resume, find it as it was at the
update's start. An assignment anywhere else is refused at once; a change in place is caught at the next call; a
value that is not finite is refused when the method returns, before any checkpoint could keep it.
"""

import functools
import sys
from dataclasses import fields
from pathlib import Path
from typing import ClassVar, Optional

import torch
import torch.distributed as dist

from .checkpoints import FieldsState, value_problem
from .distributed import all_reduce
from .errors import Fault

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "UpdateState",
]


def same_values(a, b) -> bool:
    """Whether two of a state's values (as state_dict gives them) are equal, tensors bit for bit."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[key], b[key]) for key in a)
    return type(a) is type(b) and a == b


class UpdateState(FieldsState):
    """A dataclass of plain values and tensors that changes only in its method CHANGED_IN (`after_update`), which the
    training loop calls on every rank once per update, after training. Elsewhere an assignment to a field raises at
    once (AttributeError naming the field, the function and line that assigned it, and the method to use); a change
    in place (a tensor's add_, a list's append) is caught when the method is next called, naming the field. When the
    method returns, every field of every rank must hold finite values, or every rank raises a Fault naming the field
    and the rank (a collective: one all-reduce). Restored from a checkpoint with load_state_dict (FieldsState's)."""

    CHANGED_IN: ClassVar[str] = "after_update"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        method = cls.__dict__.get(cls.CHANGED_IN)
        if method is None or getattr(method, "changes_state", False):
            return

        @functools.wraps(method)
        def changing(self, *args, **kwargs):
            self.check_unchanged()
            object.__setattr__(self, "_changing", True)
            try:
                out = method(self, *args, **kwargs)
            finally:
                object.__setattr__(self, "_changing", False)
            self.check_finite()
            object.__setattr__(self, "_as_changed", self.state_dict())
            return out

        changing.changes_state = True
        setattr(cls, cls.CHANGED_IN, changing)

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__ and not self.__dict__.get("_changing"):
            caller = sys._getframe(1)
            where = f"{caller.f_code.co_name} ({Path(caller.f_code.co_filename).name}:{caller.f_lineno})"
            what = type(self).__name__
            raise AttributeError(f"{what}.{name} is assigned in {where}: the algorithm's state changes only in "
                                 f"{what}.{self.CHANGED_IN}, which main calls once per update after training (so that "
                                 "a stop, a fault and a resume find it as it was at the update's start): make the "
                                 "change there")
        object.__setattr__(self, name, value)
        if "_as_changed" not in self.__dict__ and all(f.name in self.__dict__ for f in fields(self)):
            object.__setattr__(self, "_as_changed", self.state_dict())  # made: what a change in place is told from

    def load_state_dict(self, saved: dict) -> None:
        object.__setattr__(self, "_changing", True)
        try:
            super().load_state_dict(saved)
        finally:
            object.__setattr__(self, "_changing", False)
        object.__setattr__(self, "_as_changed", self.state_dict())

    def check_unchanged(self) -> None:
        """Every field as the last call of CHANGED_IN (or the start, or a restore) left it, or a RuntimeError naming
        the first that changed in place."""
        before = self.__dict__.get("_as_changed")
        if before is None:
            return
        now = self.state_dict()
        for name in now:
            if not same_values(now[name], before[name]):
                what = type(self).__name__
                raise RuntimeError(f"{what}.{name} changed in place outside {what}.{self.CHANGED_IN} (since its last "
                                   "call, or since the state was made or restored): the algorithm's state changes "
                                   f"only there, once per update after training; make the change there (assign a new "
                                   "value: x = x + 1, not x.add_(1) or a list's append elsewhere)")

    def problem(self) -> Optional[str]:
        """The first field that holds a value a checkpoint cannot keep (not finite, too large), or None."""
        counted = [0]
        for f in fields(self):
            if problem := value_problem(getattr(self, f.name), None, f"{type(self).__name__}.{f.name}", counted):
                return problem
        return None

    def check_finite(self) -> None:
        """Collective: every rank's fields checked (problem); any rank's problem raises a Fault on every rank."""
        problem = self.problem()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:  # a CPU tensor: gloo's, on GPUs too (the process group is "cuda:nccl,cpu:gloo")
            if not all_reduce(torch.tensor([float(problem is not None)]), dist.ReduceOp.MAX).item():
                return
            problems = [None] * world
            dist.all_gather_object(problems, problem)
        else:
            problems = [problem]
        failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
        if failed:
            rank, problem = failed[0]
            on = f" on rank {rank}" if world > 1 else ""
            raise Fault(f"{problem}{on} after {type(self).__name__}.{self.CHANGED_IN}: a checkpoint keeps finite state "
                        "only, so the run stops here with nothing saved (the newest checkpoint is as it was); fix the "
                        "change that made it", announce=not dist.is_initialized() or dist.get_rank() == 0)
