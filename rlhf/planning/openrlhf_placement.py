"""What OpenRLHF v0.9.5's `train_ppo_ray` would place for the same flags (Ray placement groups, one GPU per bundle),
beside the single program's rank plan, with what differs and why: printed by `--dry_run` for the RL jobs.

OpenRLHF's rules: each role's group has --{role}_num_nodes x --{role}_num_gpus_per_node GPUs (defaults 1 x 8); a
reference exists when --init_kl_coef > 0, a critic with a critic estimator (gae), reward models unless
--remote_rm_url; --colocate_actor_ref (or --colocate_all_models) puts the reference in the actor's group,
--colocate_critic_reward the reward models in the critic's, --colocate_all_models every model and the vLLM engines
in the actor's; --vllm_num_engines N x --vllm_tensor_parallel_size T GPUs hold the engines otherwise. Reads the
config only.
"""

from __future__ import annotations

from typing import Any

from rlhf.distributed.topology import Role

OPENRLHF_GPUS_PER_ROLE = 8
"""OpenRLHF's default --{role}_num_gpus_per_node (here 0: the whole world)."""


def _gpus(cfg: Any, role: str) -> int:
    """OpenRLHF's GPU count for `role`: the flags as given, OpenRLHF's default 8 per node where none was."""
    placement = cfg.placement.by_role[role]
    return placement.num_nodes * (placement.num_gpus_per_node or OPENRLHF_GPUS_PER_ROLE)


def _count(gpus: int) -> str:
    return f"{gpus} GPU" + ("" if gpus == 1 else "s")


def openrlhf_groups(cfg: Any) -> list[tuple[str, int]]:
    """OpenRLHF's placement groups for `cfg`: (what the group holds, its GPU count), in its creation order."""
    p, r = cfg.placement, cfg.rollout
    has_ref = cfg.algo.init_kl_coef > 0  # OpenRLHF v0.9.5 builds the reference only then
    has_critic = cfg.schedule.uses_critic
    has_reward = not cfg.reward.remote_rm_url
    engines = r.vllm_num_engines or 0
    actor = ["actor"] + (["reference"] if has_ref and (p.colocate_actor_ref or p.colocate_all_models) else [])
    groups: list[tuple[list[str], int]] = []
    if p.colocate_all_models:
        actor += [n for n, on in (("critic", has_critic), ("reward", has_reward)) if on]
        if engines and not r.async_train:
            actor.append(f"{engines} vLLM engine(s) of TP {r.vllm_tensor_parallel_size}")
            engines = 0
    groups.append((actor, _gpus(cfg, "actor")))
    if has_ref and "reference" not in actor:
        groups.append((["reference"], _gpus(cfg, "ref")))
    if not p.colocate_all_models:
        if has_critic and p.colocate_critic_reward and has_reward:
            groups.append((["critic", "reward"], _gpus(cfg, "critic")))
        else:
            groups += [([n], _gpus(cfg, role)) for n, role, on in (("critic", "critic", has_critic),
                                                                  ("reward", "reward", has_reward)) if on]
    if engines:
        groups.append(([f"{engines} vLLM engine(s) of TP {r.vllm_tensor_parallel_size}"],
                       engines * r.vllm_tensor_parallel_size))
    return [(" + ".join(names), gpus) for names, gpus in groups]


def comparison_lines(cfg: Any, plan: dict[Role, tuple[int, ...]], world: int) -> list[str]:
    """OpenRLHF's placement of these flags, then what differs in the plan that will run and why."""
    groups = openrlhf_groups(cfg)
    total = sum(gpus for _, gpus in groups)
    lines = [f"OpenRLHF's placement of these flags (train_ppo_ray, one GPU per Ray bundle): {_count(total)}",
             *(f"  {_count(gpus)}: {names}" for names, gpus in groups),
             f"what differs here (one program over the {world} launched ranks):"]
    r, p = cfg.rollout, cfg.placement
    tp = r.vllm_tensor_parallel_size
    if r.async_train:
        lines.append(f"  rollout: {r.vllm_num_engines} engine(s) of TP {tp} on {len(plan.get(Role.ROLLOUT, ()))} "
                     "ranks of their own, as OpenRLHF's --async_train places them")
    else:
        engines = r.vllm_num_engines or 0
        asked = f"--vllm_num_engines {engines} on GPUs of their own" if engines and not p.colocate_all_models \
            else f"--vllm_num_engines {engines} in the actor's group" if engines else \
            "generation by the actor's own model (OpenRLHF without --vllm_num_engines)"
        lines.append(f"  rollout: {world // tp} engine(s) of TP {tp} inside the training ranks' own processes "
                     f"(asleep while the models train), instead of {asked}: the engine count is the world size / TP")
    placed = {"actor": True, "critic": cfg.schedule.uses_critic, "reward": not cfg.reward.remote_rm_url,
              "ref": cfg.algo.init_kl_coef > 0}  # the roles OpenRLHF gives GPUs
    unsized = [role for role, on in placed.items() if on and p.by_role[role].num_gpus_per_node == 0
               and Role.define(role) in plan]
    if unsized and not p.colocate_all_models:
        lines.append(f"  {', '.join(unsized)}: no --*_num_gpus_per_node given, so every rank of the world (OpenRLHF: "
                     f"{OPENRLHF_GPUS_PER_ROLE} GPUs each)")
    if total != world:
        lines.append(f"  GPU count: OpenRLHF would ask Ray for {_count(total)}; this run has the {world} ranks the "
                     "launcher started")
    return lines
