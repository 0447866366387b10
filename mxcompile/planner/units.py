"""Decision units: tensors that must share one decision (identical repeated blocks).

A *unit* is a group of saved tensors the solvers decide together. Without tie groups every
tensor is its own unit. ``tie_groups`` (a sequence of name sequences) ties tensors into one
unit: the ILP gives the unit one set of choice variables, the heuristic moves it as a whole.
:func:`mxcompile.planner.plan_repeated` uses this so that n identical transformer blocks cost
one block's worth of decision variables while memory is still checked at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .memory import Tables

TieGroups = Sequence[Sequence[str]]


@dataclass(frozen=True)
class Units:
    """``members[u]``: tensor indices of unit u (ascending); ``of_tensor[i]``: unit of tensor i;
    ``allowed[u]``: decision codes open to every member. Units are ordered by their first member."""

    members: tuple[tuple[int, ...], ...]
    of_tensor: tuple[int, ...]
    allowed: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.members)

    def expand(self, unit_codes: Sequence[int]) -> list[int]:
        """Per-tensor codes from per-unit codes."""
        return [unit_codes[u] for u in self.of_tensor]


def build_units(tables: Tables, tie_groups: TieGroups | None = None) -> Units:
    """Units of ``tables.problem`` under ``tie_groups``; errors name the offending group."""
    problem = tables.problem
    names = problem.tensor_index()
    group_of: dict[int, int] = {}
    groups: list[list[int]] = []
    for g, group in enumerate(tie_groups or ()):
        if isinstance(group, str):
            raise ValueError(f"tie_groups[{g}]={group!r}: give a sequence of tensor names, not a str")
        indices = []
        for name in group:
            if name not in names:
                raise ValueError(f"tie_groups[{g}] names {name!r}, which is not a saved tensor")
            index = names[name]
            if index in group_of:
                raise ValueError(f"tie_groups[{g}] names {name!r}, already in tie_groups[{group_of[index]}]")
            group_of[index] = g
            indices.append(index)
        groups.append(sorted(indices))
    members: list[tuple[int, ...]] = []
    for i in range(len(problem.tensors)):
        if i not in group_of:
            members.append((i,))
        elif groups[group_of[i]][0] == i:
            members.append(tuple(groups[group_of[i]]))
    of_tensor = [0] * len(problem.tensors)
    allowed = []
    for u, unit in enumerate(members):
        opened = set(tables.allowed[unit[0]])
        for i in unit:
            of_tensor[i] = u
            opened &= set(tables.allowed[i])
        allowed.append(tuple(sorted(opened)))
    return Units(members=tuple(members), of_tensor=tuple(of_tensor), allowed=tuple(allowed))
