"""Which ranks host which role, and every process group the job uses.

`plan_ranks` is a pure function from a placement to rank ranges. `Topology` is built once on every
rank, in the same order, and is the only place that calls `dist.new_group`; nothing else keeps groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch.distributed as dist


class _Roles(type):
    def __iter__(cls) -> Iterator[Role]:
        return iter(tuple(cls._defined))


class Role(metaclass=_Roles):
    """A model's part in a job. An open set: the RL roles are defined here, and a job defines its own
    (`Role.define("teacher")`). One object per name (compare with `is`); iterating over `Role` yields the
    roles in the order they were defined, which is the order `Topology` creates their groups in (the same
    on every rank, since every rank runs the same code)."""

    _defined: ClassVar[list[Role]] = []
    ACTOR: ClassVar[Role]
    CRITIC: ClassVar[Role]
    REWARD: ClassVar[Role]
    REF: ClassVar[Role]
    ROLLOUT: ClassVar[Role]
    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    @classmethod
    def define(cls, value: str) -> Role:
        """The role named `value`, created on first use."""
        for role in cls._defined:
            if role.value == value:
                return role
        role = cls(value)
        cls._defined.append(role)
        return role

    def __repr__(self) -> str:
        return f"Role({self.value!r})"

    def __reduce__(self):
        return (Role.define, (self.value,))


Role.ACTOR = Role.define("actor")
Role.CRITIC = Role.define("critic")
Role.REWARD = Role.define("reward")
Role.REF = Role.define("ref")
Role.ROLLOUT = Role.define("rollout")


@dataclass(frozen=True)
class Placement:
    """Requested rank counts per role and which roles share ranks.

    `num_ranks[role] == 0` means "the whole world". Roles in one `colocate` set share the same
    ranks (their counts must agree, or be 0). ROLLOUT always spans the whole world because vLLM's
    external launcher builds its groups over every rank.
    """

    num_ranks: dict[Role, int]
    colocate: tuple[frozenset[Role], ...] = field(default=())
    rollout_ranks: int = 0  # > 0: the world's last ranks only generate (--async_train); the roles share the rest

    @staticmethod
    def colocated(roles: tuple[Role, ...]) -> Placement:
        """Every role on every rank (the hybrid engine)."""
        return Placement({role: 0 for role in roles}, (frozenset(roles),))


def _slots(placement: Placement) -> list[tuple[Role, ...]]:
    """Roles grouped into slots that share ranks, in a deterministic order."""
    order = [r for r in Role if r in placement.num_ranks and r is not Role.ROLLOUT]
    seen: set[Role] = set()
    slots = []
    for role in order:
        if role in seen:
            continue
        group = next((c for c in placement.colocate if role in c), frozenset({role}))
        slot = tuple(r for r in order if r in group)
        seen.update(slot)
        slots.append(slot)
    return slots


def plan_ranks(placement: Placement, world_size: int) -> dict[Role, tuple[int, ...]]:
    """Assign each role a consecutive rank range; ROLLOUT gets all ranks.

    A slot whose roles all ask for 0 ranks spans the whole world. Otherwise slots are laid out
    back to back and must add up to exactly `world_size`. With `placement.rollout_ranks` = G > 0, ROLLOUT
    gets the last G ranks alone, and "the world" above means the ranks before them (the training ranks).
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    generating = placement.rollout_ranks
    if not 0 <= generating < world_size:
        raise ValueError(f"{generating} generation ranks leave no training rank in a world of {world_size}")
    training = world_size - generating
    plan: dict[Role, tuple[int, ...]] = {}
    start = 0
    sized = []
    for slot in _slots(placement):
        counts = {placement.num_ranks[r] for r in slot} - {0}
        if len(counts) > 1:
            names = ", ".join(f"{r.value}={placement.num_ranks[r]}" for r in slot)
            raise ValueError(f"colocated roles must use the same number of ranks, got {names}")
        if not counts:
            for role in slot:
                plan[role] = tuple(range(training))
            continue
        count = counts.pop()
        sized.append((slot, count))
        for role in slot:
            plan[role] = tuple(range(start, start + count))
        start += count
    if sized and start != training:
        detail = " + ".join(f"{'/'.join(r.value for r in s)}={n}" for s, n in sized)
        where = (f"the world has {world_size} ranks" if not generating else
                 f"{training} ranks train ({world_size} minus {generating} generation ranks)")
        raise ValueError(f"role rank counts add up to {start} ({detail}) but {where}; "
                         "adjust --{role}_num_nodes x --{role}_num_gpus_per_node or colocate roles")
    plan[Role.ROLLOUT] = tuple(range(training, world_size)) if generating else tuple(range(world_size))
    return plan


class Topology:
    """Process groups of one job. Construct on every rank with identical arguments.

    Creates, in this order: one group per role in `plan` (Role order; DeepSpeed reduces gradients
    over it), one group per rollout engine (`rollout_tp` consecutive ranks each), when some role
    runs on a subgroup one single-rank group per rank, with `ring_size` > 1 the ring-attention
    (sequence-parallel) groups: `ring_size` consecutive ranks of each role's ranks, and with `hpz_size` > 1
    (--zpg at ZeRO-3) the ZeRO++ secondary-partition groups: `hpz_size` consecutive ranks of each role's ranks.

    With `tp_size` > 1 (--ds_tensor_parallel_size) last, for each role: its tensor-parallel groups (`tp_size`
    consecutive ranks) and its data groups (the ranks at the same place of every tensor-parallel group, over
    which DeepSpeed reduces gradients and ZeRO partitions).

    The ranks of one ring hold the same samples (each a shard of their tokens), and so do the ranks of one
    tensor-parallel group (each computes a slice of every split layer): a role's data-parallel size is its rank
    count / `replica_size` (ring or tensor-parallel size; not both).
    """

    def __init__(self, plan: dict[Role, tuple[int, ...]], rollout_tp: int = 1, ring_size: int = 1,
                 hpz_size: int = 1, tp_size: int = 1) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.world_size % rollout_tp:
            raise ValueError(f"world size {self.world_size} is not a multiple of --vllm_tensor_parallel_size "
                             f"{rollout_tp}")
        self.plan = dict(plan)
        self.rollout_tp = rollout_tp
        self._groups: dict[Role, dist.ProcessGroup] = {}
        for role in Role:
            if role in self.plan:
                self._groups[role] = dist.new_group(list(self.plan[role]))
        # --async_train: the ranks that train (every role but ROLLOUT) collect experience among themselves
        generating = self.plan.get(Role.ROLLOUT, tuple(range(self.world_size)))
        self.training_ranks = tuple(r for r in range(self.world_size) if r not in generating) or generating
        self.trainer_group = (dist.new_group(list(self.training_ranks))
                              if len(self.training_ranks) < self.world_size else None)
        # DeepSpeed's mpu needs a model-parallel group of one rank when a role runs on a subgroup.
        self.has_subgroups = any(len(r) != self.world_size for r in self.plan.values())
        self._self_groups = [dist.new_group([r]) for r in range(self.world_size)] if self.has_subgroups else []
        self.ring_size = ring_size
        self._ring_groups = (self._blocks_of_each_role(ring_size, f"rings of --ring_attn_size {ring_size}",
                                                       "the ring size") if ring_size > 1 else {})
        self.hpz_size = hpz_size
        self._hpz_groups = (self._blocks_of_each_role(hpz_size, f"groups of --zpg {hpz_size}", "--zpg")
                            if hpz_size > 1 else {})
        if ring_size > 1 and tp_size > 1:
            raise ValueError("ring attention and tensor parallelism together are not built")
        self.tp_size = tp_size
        self._tp_groups = (self._blocks_of_each_role(
            tp_size, f"tensor-parallel groups of --ds_tensor_parallel_size {tp_size}", "--ds_tensor_parallel_size")
            if tp_size > 1 else {})
        if tp_size > 1:
            self._check_one_data_group_per_rank()
        self._data_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for role in Role if tp_size > 1 else ():
            if role in self.plan and role is not Role.ROLLOUT:
                for rank in self.plan[role][:tp_size]:  # one rank at each place of a tensor-parallel group
                    ranks = self._data_ranks(role, rank)
                    if ranks not in self._data_groups:  # roles on the same ranks share their data groups
                        self._data_groups[ranks] = dist.new_group(list(ranks))

    def _data_ranks(self, role: Role, rank: int) -> tuple[int, ...]:
        """The ranks of `role` at `rank`'s place in each of the role's tensor-parallel groups (its data group)."""
        ranks = self.plan[role]
        return ranks[ranks.index(rank) % self.tp_size::self.tp_size]

    def _check_one_data_group_per_rank(self) -> None:
        """DeepSpeed keeps one tensor-parallel and one data group per process (`use_tensor_parallel_groups`): the
        roles a rank hosts must share them. Checked for every rank before any group is made, so every rank raises
        alike."""
        for rank in range(self.world_size):
            hosted = {role.value: self._data_ranks(role, rank)
                      for role, ranks in self.plan.items() if role is not Role.ROLLOUT and rank in ranks}
            if len(set(hosted.values())) > 1:
                detail = ", ".join(f"{name} with ranks {list(ranks)}" for name, ranks in hosted.items())
                raise ValueError(f"--ds_tensor_parallel_size {self.tp_size}: rank {rank} hosts roles whose data "
                                 f"groups differ ({detail}), which DeepSpeed's AutoTP cannot hold in one process; "
                                 "place each role on all of the ranks it shares or on ranks of its own")

    def _blocks_of_each_role(self, size: int, blocks_of: str, fix: str) -> dict[tuple[int, ...], dist.ProcessGroup]:
        """A group for every `size` consecutive ranks of each role but ROLLOUT (roles on the same ranks share
        them), created in Role order; a role whose rank count `size` does not divide is an error naming
        `blocks_of` and the `fix`."""
        blocks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for role in Role:
            if role in self.plan and role is not Role.ROLLOUT:
                ranks = self.plan[role]
                if len(ranks) % size:
                    raise ValueError(f"the {len(ranks)} {role.value} ranks do not split into {blocks_of}; change "
                                     f"the role's rank count or {fix}")
                for start in range(0, len(ranks), size):
                    block = ranks[start:start + size]
                    if block not in blocks:
                        blocks[block] = dist.new_group(list(block))
        return blocks

    @property
    def self_group(self) -> dist.ProcessGroup | None:
        """A group holding only this rank (created only when some role runs on a subgroup)."""
        return self._self_groups[self.rank] if self._self_groups else None

    def hosts(self, role: Role) -> bool:
        return role in self.plan and self.rank in self.plan[role]

    def ranks(self, role: Role) -> tuple[int, ...]:
        return self.plan[role]

    def group(self, role: Role) -> dist.ProcessGroup:
        """All ranks of `role` (only meaningful on ranks that host it): DeepSpeed's gradient group."""
        return self._groups[role]

    @property
    def replica_size(self) -> int:
        """Consecutive ranks of a role that hold the same samples: a ring, or a tensor-parallel group."""
        return self.ring_size * self.tp_size

    def dp_size(self, role: Role) -> int:
        """Data-parallel replicas of `role`: its ranks / `replica_size` (the ranks of a replica share samples)."""
        return len(self.plan[role]) // self.replica_size

    def dp_rank(self, role: Role) -> int:
        return self.plan[role].index(self.rank) // self.replica_size

    def replica_rank(self, role: Role) -> int:
        """This rank's place in its replica of `role` (0: the rank that counts the replica's samples once)."""
        return self.plan[role].index(self.rank) % self.replica_size

    def _block_of(self, role: Role, size: int, blocks: dict[tuple[int, ...], dist.ProcessGroup]
                  ) -> dist.ProcessGroup | None:
        """The group of the `size` consecutive ranks of `role` that hold this rank (`_blocks_of_each_role`); None
        when `size` is 1."""
        if size == 1:
            return None
        start = self.plan[role].index(self.rank) // size * size
        return blocks[self.plan[role][start:start + size]]

    def tp_group(self, role: Role) -> dist.ProcessGroup | None:
        """This rank's tensor-parallel group for `role`; None without tensor parallelism."""
        return self._block_of(role, self.tp_size, self._tp_groups)

    def data_group(self, role: Role) -> dist.ProcessGroup:
        """The ranks of `role` that DeepSpeed reduces this rank's gradients over and partitions its ZeRO states
        over: the role's group, or with tensor parallelism the ranks at this rank's place in each of the role's
        tensor-parallel groups."""
        if self.tp_size == 1:
            return self.group(role)
        return self._data_groups[self._data_ranks(role, self.rank)]

    def ring_rank(self, role: Role) -> int:
        """This rank's position in its ring of `role` (0 without ring attention)."""
        return self.plan[role].index(self.rank) % self.ring_size

    def ring_group(self, role: Role) -> dist.ProcessGroup | None:
        """This rank's ring-attention group for `role`; None without ring attention."""
        return self._block_of(role, self.ring_size, self._ring_groups)

    def hpz_group(self, role: Role) -> dist.ProcessGroup | None:
        """This rank's ZeRO++ secondary-partition group for `role` (--zpg consecutive ranks of it); None when
        --zpg is 1."""
        return self._block_of(role, self.hpz_size, self._hpz_groups)

    def leads(self, role: Role) -> bool:
        """Whether this is the first rank of `role` (the one that writes its files and reports its norms)."""
        return self.hosts(role) and self.plan[role][0] == self.rank

    @property
    def generates(self) -> bool:
        """Whether this rank's engine generates the step's samples (all ranks, except with --async_train)."""
        return self.rank in self.plan.get(Role.ROLLOUT, range(self.world_size))

    @property
    def num_engines(self) -> int:
        """Rollout engines that generate the step's samples."""
        return len(self.plan.get(Role.ROLLOUT, range(self.world_size))) // self.rollout_tp

    @property
    def rollout_index(self) -> int:
        """Which of the `num_engines` generating engines this rank belongs to (only where it `generates`)."""
        return self.plan.get(Role.ROLLOUT, range(self.world_size)).index(self.rank) // self.rollout_tp

    @property
    def engine_index(self) -> int:
        """Which rollout engine (of every rank's, generating or not: its TP group) this rank belongs to."""
        return self.rank // self.rollout_tp

    @property
    def engine_rank(self) -> int:
        """This rank's position inside its rollout engine's TP group."""
        return self.rank % self.rollout_tp
