"""Chaos: a PPO run that faults keep hitting ends on the weights and metrics of the run nothing hit.

    python benchmarks/chaos.py [--faults 20] [--steps 100] [--seed 0] [--kinds kill9,sigstop,...] [--out DIR]
                               [--async_save]

PPO with a critic (GAE, the embedded tiny policy, rewards from the embedded reward model behind `serve_rm`, ZeRO-2,
2 CPU ranks, a checkpoint after every step, `--load_checkpoint`) runs twice through `rlhf.cli.launch`: once
straight, once while a random schedule of faults hits it. The chaos run is relaunched whenever a fault ends it, as a
scheduler requeues a job. The faults, spread evenly over the steps (the faults left over the steps left, at least a
new step apart), each at a random moment of the step after it (up to 1 s):

    kill9     SIGKILL of a random rank: torchrun restarts the workers (--max-restarts), which resume
    sigstop   SIGSTOP of a random rank: the other rank's heartbeat names it and ends the run within
              --dist_timeout (0.5 min here: after 15 s), the launcher continues the stopped rank so that it
              acts on torchrun's SIGTERM at once, torchrun restarts the workers
    sigterm   SIGTERM to the launcher: the workers checkpoint and exit 0; relaunched
    sigusr1   SIGUSR1 to the launcher (SLURM's warning signal): the same
    sigint    Ctrl-C to the launcher: the step's work is dropped, a checkpoint written, exit 130; relaunched
    truncate  after a launcher stop, the newest checkpoint's largest file is cut in half before the relaunch:
              the resume names it and falls back to the newest intact checkpoint
    rmkill    SIGKILL of the reward server, restarted 0-2 s later on its port: the trainer's client retries
              (--remote_rm_retries: for most of --dist_timeout) until it answers
    diskfull  the checkpoints' filesystem (a tmpfs mounted for the run: needs root) filled until a save fails
              ("no space left"), then freed: torchrun restarts the workers, which resume

Reported: the faults and how each ended, the steps done twice (the steps a fault's restart had to redo), the time
lost against the straight run, the seconds from each fault to the next new step (by kind), and whether the final
weights (every tensor, bit for bit) and every step's metrics equal the straight run's. Each relaunch pays the job's
start (imports, 10-14 s in the launcher on 2 CPU cores, then the engines); a torchrun restart forks its workers from
the warm launcher and pays the engines only (`rlhf.cli.warm_start`). 20 faults take 4-6 minutes on 2 CPU
cores. tests/e2e/test_chaos.py runs a handful of faults on the same job. `--async_save`: the chaos run writes its
checkpoints in the background (faults then also meet checkpoints still being written), and must still end on the
straight run's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from rlhf.cli.launch import child_pids
from rlhf.rewards.remote import retry_sleeps_s

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ("kill9", "sigstop", "sigterm", "sigusr1", "sigint", "truncate", "rmkill", "diskfull")
LAUNCHER_SIGNALS = {"sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1, "sigint": signal.SIGINT}


def ppo_flags(tiny: str, steps: int, reward_url: str, dist_timeout_min: float = 0.5) -> list[str]:
    """The chaos job. dist_timeout_min: 0.5 makes the heartbeat name a stopped rank after 15 s (the sigstop fault:
    half the timeout); a run without that fault can give a slow reward-server restart longer. The reward client
    retries for most of that timeout (`retries_within`): a restarted server (7-8 s on an idle machine, 20 s and more
    on a loaded one) is waited for, and the ranks that wait in the next collective meanwhile do not time out."""
    retries = retries_within(0.8 * dist_timeout_min * 60)
    return ["--pretrain", f"{tiny}/policy", "--remote_rm_url", reward_url, "--remote_rm_retries", str(retries),
            "--critic_pretrain", f"{tiny}/reward_model",
            "--prompt_data", f"{tiny}/prompts.jsonl", "--input_key", "input",
            "--param_dtype", "fp32", "--attn_implementation", "sdpa", "--enforce_eager",
            "--advantage_estimator", "gae", "--init_kl_coef", "0.001", "--normalize_reward",
            "--n_samples_per_prompt", "1", "--rollout_batch_size", "16", "--micro_rollout_batch_size", "16",
            "--train_batch_size", "16", "--micro_train_batch_size", "8", "--generate_max_len", "8",
            "--prompt_max_len", "16", "--actor_learning_rate", "2e-3", "--critic_learning_rate", "5e-3",
            "--zero_stage", "2", "--max_steps", str(steps), "--num_episodes", "100", "--seed", "1",
            "--save_steps", "1", "--max_ckpt_num", "3", "--dist_timeout", str(dist_timeout_min)]


def retries_within(window_s: float) -> int:
    """The most tries whose sleeps between them (`retry_sleeps_s`) add up to at most window_s."""
    retries = 1
    while retry_sleeps_s(retries + 1) <= window_s:
        retries += 1
    return retries


class RewardServer:
    """`serve_rm` with the embedded reward model on a fixed local port, in its own process; `restart` kills it
    (SIGKILL) and starts it again on the same port."""

    def __init__(self, tiny: str, log) -> None:
        self.tiny, self.log, self.port = tiny, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}/get_reward"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "rlhf.cli.serve_rm", "--reward_pretrain", f"{self.tiny}/reward_model",
               "--param_dtype", "fp32", "--attn_implementation", "sdpa", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
        deadline = time.monotonic() + 120
        while True:  # listening: the model is loaded (serve_rm binds after loading it)
            if self.proc.poll() is not None:
                raise SystemExit(f"serve_rm exited {self.proc.returncode}: see {self.log.name}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"serve_rm did not listen within 120 s: see {self.log.name}") from None
                time.sleep(0.2)

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def mount_tmpfs(path: str, size_mb: int) -> bool:
    """A tmpfs of `size_mb` at `path` (for the diskfull fault); False where this process may not mount."""
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", path],
                          capture_output=True).returncode == 0


def fill(path: str, leave: int = 16 << 10) -> str:
    """Grows a ballast file until `leave` bytes are free on `path`'s filesystem (again after the run freed some:
    its rotation of old checkpoints); its path."""
    ballast = os.path.join(path, ".ballast")
    free = shutil.disk_usage(path).free
    with open(ballast, "ab") as f:
        chunk = b"\0" * (1 << 20)
        left = max(0, free - leave)
        try:
            while left > 0:
                left -= f.write(chunk[:min(left, len(chunk))])
        except OSError:  # full already
            pass
    return ballast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(flags: list[str], out: str, restarts: int, log, resume: bool = False,
           ckpt: str | None = None) -> subprocess.Popen:
    """The job into `out` (checkpoints in `ckpt`, default out/ckpt); `resume`: with --load_checkpoint."""
    cmd = [sys.executable, "-m", "rlhf.cli.launch", "--grace_period", "120", f"--max-restarts={restarts}",
           "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "rlhf.cli.train_ppo", *flags, "--save_path", out, "--ckpt_path", ckpt or os.path.join(out, "ckpt"),
           *(["--load_checkpoint"] if resume else [])]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})


def logged_steps(out: str) -> list[int]:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["step"] for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def truncate_newest(ckpt: str) -> str | None:
    """Cut the newest complete checkpoint's largest file in half; its path, or None when there is none."""
    from rlhf.utils.checkpoint_files import complete_checkpoints

    found = complete_checkpoints(ckpt)
    if not found:
        return None
    files = [os.path.join(d, n) for d, _, names in os.walk(found[-1][1]) for n in names]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) // 2)
    return target


RESTARTING = ("kill9", "sigstop", "diskfull")  # torchrun restarts the workers within the launch


def ends_workers(event: dict) -> bool:
    """Whether the fault ended the workers (a resume follows): not a reward server restart (the client's retries
    ride it out), nor a full disk that met no save."""
    return event["fault"] != "rmkill" and event.get("then") != "no save failed"


class Chaos:
    """Runs the job under faults until it has done `steps` steps; `events` lists what happened. `reward`: the
    reward server the flags point at; `ckpt`: the checkpoints' directory (a tmpfs for diskfull)."""

    def __init__(self, flags: list[str], out: str, steps: int, faults: int, kinds: list[str], seed: int,
                 reward: RewardServer, ckpt: str, in_order: bool = False, spread: bool = True) -> None:
        self.flags, self.out, self.steps, self.faults, self.kinds = flags, out, steps, faults, kinds
        self.in_order = in_order  # the faults are `kinds` in turn, not drawn at random
        self.spread = spread  # the faults spread evenly over the steps, not each at the first new step
        self.reward, self.ckpt = reward, ckpt
        self.rng = random.Random(seed)
        self.events: list[dict] = []
        self.redone = 0
        self.launches = 0
        self.resumes: list[int] = []
        self.progress: list[tuple[float, int]] = []  # (time, newest logged step) at each rise of the newest step
        self.console = os.path.join(os.path.dirname(self.out), "chaos_console.log")

    def run(self) -> float:
        start = self.started = time.monotonic()
        log = open(self.console, "w")
        pending_truncate = False
        while True:
            if pending_truncate:
                cut = truncate_newest(self.ckpt)
                self.events[-1]["then"] = f"truncated {os.path.relpath(cut, self.ckpt) if cut else 'nothing'}"
                pending_truncate = False
            log.write(f"=== launch {self.launches}\n")
            log.flush()
            proc = launch(self.flags, self.out, restarts=self.faults + 1, log=log, resume=self.launches > 0,
                          ckpt=self.ckpt)
            self.launches += 1
            ended_by = self._inject_until_exit(proc)
            done = logged_steps(self.out)
            if done and done[-1] >= self.steps and proc.returncode == 0 and ended_by is None:
                break
            if ended_by is None:
                raise SystemExit(f"the chaos run ended with exit {proc.returncode} without a fault to blame: see "
                                 f"{log.name}")
            pending_truncate = ended_by == "truncate"
        log.close()
        self._count_redone()
        return time.monotonic() - start

    def _inject_until_exit(self, proc: subprocess.Popen) -> str | None:
        """Faults into this launch until it exits; the launcher-level fault that ended it, if any."""
        while proc.poll() is None:
            if len(self.events) >= self.faults:
                self._wait_for_step(proc, self.steps + 1)  # follows the steps to the end: the last fault's recovery
                proc.wait()
                return None
            seen = logged_steps(self.out)
            last = seen[-1] if seen else 0
            if not self._wait_for_step(proc, self._spread_step(len(self.events), last)):
                return None
            if logged_steps(self.out)[-1] >= self.steps - 1:  # too late in the run for another fault
                self._wait_for_step(proc, self.steps + 1)
                proc.wait()
                return None
            time.sleep(self.rng.uniform(0, self._step_s()))  # somewhere in the step after the one just logged
            kind = self.kinds[len(self.events) % len(self.kinds)] if self.in_order else self.rng.choice(self.kinds)
            event = {"fault": kind, "at_step": logged_steps(self.out)[-1], "t": time.monotonic()}
            if kind in ("kill9", "sigstop"):
                ranks = child_pids(proc.pid)  # the launcher runs torchrun: its children are the ranks
                if not ranks:
                    continue
                victim = self.rng.randrange(len(ranks))
                os.kill(ranks[victim], signal.SIGKILL if kind == "kill9" else signal.SIGSTOP)
                event["rank_pid"] = ranks[victim]
                self.events.append(event)
                continue  # torchrun restarts the workers within this launch
            if kind == "rmkill":
                self.reward.restart(down_s=self.rng.uniform(0, 2))
                self.events.append(event)
                continue
            if kind == "diskfull":
                event["filled_at_step"] = event["at_step"]
                event["then"] = self._fill_until_a_save_fails(proc)
                event["at_step"] = logged_steps(self.out)[-1]
                self.events.append(event)
                continue
            os.kill(proc.pid, LAUNCHER_SIGNALS.get(kind, signal.SIGTERM))
            proc.wait()
            event["exit"] = proc.returncode
            event["at_step"] = logged_steps(self.out)[-1]  # the step in progress ends and is checkpointed
            self.events.append(event)
            return kind
        return None

    def _spread_step(self, k: int, last: int) -> int:
        """The step fault k (from 0) waits for, the run having logged `last`: the faults left spread evenly over the
        steps left, so that each finds the run stepping however fast the machine steps (waiting only for a new step,
        a fast machine ran out of steps; a fixed schedule lost the last faults to the steps a fault's 0-1 s delay
        and a disk's filling let pass on a fast one)."""
        left = self.faults - k  # a step of slack for each: a launcher's signal lets the step in progress end
        return last + max(1, (self.steps - 1 - last - left) // (left + 1)) if self.spread else last + 1

    def _fill_until_a_save_fails(self, proc: subprocess.Popen) -> str:
        """Fills the checkpoints' filesystem until the run says 'no space left' (then frees it); what happened."""
        said = self._console().count("no space left on")
        ballast = fill(self.ckpt)
        try:
            deadline = time.monotonic() + 120
            while self._console().count("no space left on") == said:
                if proc.poll() is not None or time.monotonic() > deadline:
                    return "no save failed"
                time.sleep(0.1)
                fill(self.ckpt)
            return "a save failed: no space left"
        finally:
            os.remove(ballast)

    def _console(self) -> str:
        with open(self.console, errors="replace") as f:
            return f.read()

    def _wait_for_step(self, proc: subprocess.Popen, step: int) -> bool:
        while proc.poll() is None:
            seen = logged_steps(self.out)
            if seen and (not self.progress or seen[-1] > self.progress[-1][1]):
                self.progress.append((time.monotonic(), seen[-1]))
            if seen and seen[-1] >= step:
                return True
            time.sleep(0.2)
        return False

    def _step_s(self) -> float:
        """The run's recent seconds a step (at most 1 s; 1 s before two steps were seen in a row)."""
        rows = self.progress[-6:]
        pairs = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(rows, rows[1:]) if b[1] > a[1]]
        return min(1.0, sorted(pairs)[len(pairs) // 2]) if pairs else 1.0

    def recovery_seconds(self) -> list[float | None]:
        """Per fault: seconds from the fault to the first step logged past the step it hit (the run's stall, as
        seen from the metrics file, polled every 0.2 s), None if none followed."""
        out = []
        for event in self.events:
            after = [t for t, step in self.progress if t > event["t"] and step > event["at_step"]]
            out.append(round(min(after) - event["t"], 1) if after else None)
        return out

    def _count_redone(self) -> None:
        """Steps done twice: each resume (in order of the faults that end the workers) restarts after a checkpoint
        at or before the last step logged before the fault (a truncated newest checkpoint: one before it); the
        steps in between are done again. The step in progress when a rank is killed or stopped is lost, not
        counted."""
        self.resumes = [int(m) for m in re.findall(r"resumed from \S*global_step(\d+)", self._console())]
        ending = [event for event in self.events if ends_workers(event)]
        self.redone = sum(max(0, event["at_step"] - resumed) for event, resumed in zip(ending, self.resumes))


def weights(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model", "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", default=None, help="work directory (default: a new temporary one)")
    parser.add_argument("--async_save", action="store_true",
                        help="the chaos run writes its checkpoints in the background (the straight run at once)")
    args = parser.parse_args()
    import tempfile

    import torch

    from rlhf.assets import TINY_DIR

    work = args.out or tempfile.mkdtemp(prefix="chaos_")
    os.makedirs(work, exist_ok=True)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds: {', '.join(unknown)} unknown; choose from {', '.join(KINDS)}")
    ckpt = os.path.join(work, "chaos_ckpt")
    mounted = "diskfull" in kinds and mount_tmpfs(ckpt, 256)
    if "diskfull" in kinds and not mounted:
        kinds.remove("diskfull")
        print("chaos: diskfull left out: mounting a tmpfs for the checkpoints needs root (mount -t tmpfs)")
    reward_log = open(os.path.join(work, "reward_server.log"), "w")
    reward = RewardServer(TINY_DIR, reward_log)
    try:
        reward.start()
        flags = ppo_flags(TINY_DIR, args.steps, reward.url)
        straight = os.path.join(work, "straight")
        began = time.monotonic()
        with open(os.path.join(work, "straight_console.log"), "w") as log:
            code = launch(flags, straight, restarts=0, log=log).wait()
        straight_s = time.monotonic() - began
        if code != 0:
            raise SystemExit(f"the straight run failed (exit {code}): see {work}/straight_console.log")
        chaos_flags = [*flags, "--async_save"] if args.async_save else flags
        chaos = Chaos(chaos_flags, os.path.join(work, "chaos"), args.steps, args.faults, kinds, args.seed, reward,
                      ckpt)
        chaos_s = chaos.run()
    finally:
        reward.stop()
        if mounted:
            subprocess.run(["umount", ckpt], check=False)
    a, b = weights(straight), weights(chaos.out)
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))] for d in (straight, chaos.out)]
    compared = ("step", "reward_mean", "policy_loss", "critic_loss", "kl", "grad_norm")
    same_metrics = [{k: r.get(k) for k in compared} for r in rows[0]] == \
        [{k: r.get(k) for k in compared} for r in rows[1]]
    by_kind = {k: sum(e["fault"] == k for e in chaos.events) for k in kinds}
    report = {"faults": len(chaos.events), "by_kind": by_kind, "launches": chaos.launches,
              "steps_redone": chaos.redone,
              "torchrun_restarts": sum(e["fault"] in RESTARTING and ends_workers(e) for e in chaos.events),
              "resumes": len(chaos.resumes), "steps": args.steps, "straight_s": round(straight_s, 1),
              "chaos_s": round(chaos_s, 1), "time_lost_s": round(chaos_s - straight_s, 1),
              "time_lost_per_fault_s": round((chaos_s - straight_s) / max(1, len(chaos.events)), 1),
              "identical_weights": same_weights, "identical_metrics": same_metrics, "work": work}
    report["async_save"] = args.async_save
    report["events"] = [{**e, "t": round(e["t"] - chaos.started, 1)} for e in chaos.events]
    recovery = chaos.recovery_seconds()
    report["recovery_s_by_kind"] = {
        k: [r for e, r in zip(chaos.events, recovery) if e["fault"] == k] for k in kinds}
    print(f"chaos: {report['faults']} faults ({', '.join(f'{k} {n}' for k, n in by_kind.items())}) over "
          f"{args.steps} PPO steps: {chaos.launches} launches, {report['torchrun_restarts']} torchrun restarts, "
          f"{report['resumes']} resumes, {chaos.redone} steps done twice; {report['time_lost_s']} s lost against "
          f"the straight run's "
          f"{report['straight_s']} s ({report['time_lost_per_fault_s']} s a fault); final weights "
          f"{'identical' if same_weights else 'DIFFERENT'}, every step's metrics "
          f"{'identical' if same_metrics else 'DIFFERENT'}")
    def mean(seconds: list[float | None]) -> str:
        known = [s for s in seconds if s is not None]
        unseen = f", {len(seconds) - len(known)} with no step after it" if len(known) < len(seconds) else ""
        return (f"{sum(known) / len(known):.1f} s" if known else "-") + f" ({len(seconds)}{unseen})"

    print("chaos: from a fault to the next new step, by kind: " + "; ".join(
        f"{k} {mean(v)}" for k, v in report["recovery_s_by_kind"].items() if v))
    print(json.dumps(report))
    ending = sum(map(ends_workers, chaos.events))
    if len(chaos.resumes) != ending:
        print(f"chaos: {ending} faults that end the workers but {len(chaos.resumes)} resumes (see "
              f"{work}/chaos_console.log)")
    failed_to_fault = [e for e in chaos.events if e.get("then") == "no save failed"]
    if len(chaos.events) < args.faults:
        print(f"chaos: {len(chaos.events)} of the {args.faults} faults asked for fit in {args.steps} steps on this "
              f"machine (each fault lets a few steps pass before it hits): pass more --steps")
    if failed_to_fault:
        print(f"chaos: {len(failed_to_fault)} diskfull fault(s) met no save (the run ended first)")
    if not (same_weights and same_metrics):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
