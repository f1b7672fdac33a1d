"""Two nodes for real: two network namespaces joined by a veth pair (10.77.0.1/24 = node0, 10.77.0.2/24 = node1,
each with its own hostname and /etc/hosts naming both), one `python -m rlhf.cli.launch --nnodes 2 --node_rank i
--nproc_per_node 1` in each, rendezvous at node0's address: the tiny PPO demo with vLLM rollouts (one engine per
rank, started under each node's own MASTER_ADDR/LOCAL_* variables) takes the same steps as on one node with 2
ranks, exactly (metrics and final weights). The namespaces share nothing but the veth pair (each has its own
loopback), so the rendezvous and every collective cross it. Then the same over SLURM with HF generation: one slurmd
per namespace (tests/slurm_cluster.py), an sbatch of launch/train_cpu.sbatch on both nodes, one task each (srun's
SLURM_* variables, MASTER_ADDR from the node list). Needs root and `ip netns`; skips with the reason otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest
import torch

from tests.distributed import ROOT, assert_clean_output, free_port, run_job_variants
from tests.slurm_cluster import private_slurm
from tests.tiny_runs import SMALL, read_metrics

SUBNET = "10.77.0"
PPO = [*SMALL, "--rollout_engine", "hf", "--zero_stage", "2", "--seed", "3"]
NOT_COMPARED = ("time/", "perf/")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


@pytest.fixture(scope="module")
def nodes():
    """[(namespace, hostname, address)] of two namespaces that reach each other; removed afterwards."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("two network namespaces need Linux, root, iproute2 (ip) and util-linux (unshare)")
    tag = uuid.uuid4().hex[:6]
    made = []
    try:
        try:
            for i in range(2):
                _ip("netns", "add", f"rlhf{tag}n{i}")
                made.append(f"rlhf{tag}n{i}")
            _ip("link", "add", f"rv{tag}0", "type", "veth", "peer", "name", f"rv{tag}1")
        except RuntimeError as err:
            pytest.skip(f"cannot make network namespaces here: {err}")
        result = []
        for i, ns in enumerate(made):
            dev, addr = f"rv{tag}{i}", f"{SUBNET}.{i + 1}"
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: each node resolves both names
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{SUBNET}.1 node0\n{SUBNET}.2 node1\n")
            result.append((ns, f"node{i}", addr))
        yield result
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def launch_on(ns: str, hostname: str, node_rank: int, master: str, port: int, out, args=PPO) -> subprocess.Popen:
    """rlhf.cli.launch of node `node_rank` of 2 in namespace `ns`, under its own hostname (a UTS namespace)."""
    cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh",
           sys.executable, "-m", "rlhf.cli.launch", "--grace_period", "60", "--nnodes", "2", "--node_rank",
           str(node_rank), "--nproc_per_node", "1", "--master_addr", master, "--master_port", str(port),
           "-m", "rlhf.cli.train_ppo", *args, "--save_path", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def one_node(nodes, tmp_path_factory):
    """The reference: the same job on one node, 2 ranks; its save path."""
    one = tmp_path_factory.mktemp("one_node") / "run"
    run_job_variants(2, [("train_ppo", [*PPO, "--save_path", str(one)])], one.parent / "consoles", one)
    return one


def assert_same_run(one, two) -> None:
    """Equal metrics (but times) at every step and equal final weights: the same gloo collectives in the same
    order give the same numbers, not just close ones."""
    ref, got = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3]
    for a, b in zip(ref, got):
        assert strip(b) == strip(a), a["step"]
    before, after = weights(one / "model"), weights(two / "model")
    assert before.keys() == after.keys()
    for name, w in before.items():
        assert torch.equal(after[name], w), name


def run_two_nodes(nodes, two, args=PPO) -> list[tuple[str, str]]:
    """The job on the two namespaces, one rank each; (stdout, stderr) of each node's launcher."""
    port = free_port()
    procs = [launch_on(ns, host, i, nodes[0][2], port, two, args) for i, (ns, host, _) in enumerate(nodes)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=300))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for (_, host, _), p, (stdout, stderr) in zip(nodes, procs, outputs):
        assert p.returncode == 0, f"{host}:\n{stderr[-4000:]}"
        assert_clean_output(stdout, stderr)
    return outputs


@pytest.mark.vllm
def test_two_nodes_with_vllm_rollout(nodes, tmp_path):
    pytest.importorskip("vllm")
    args = [*PPO[:PPO.index("--rollout_engine")], *PPO[PPO.index("--rollout_engine") + 2:], "--rollout_engine", "vllm"]
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    run_job_variants(2, [("train_ppo", [*args, "--save_path", str(one)])], tmp_path / "consoles", one)
    run_two_nodes(nodes, two, args)
    assert_same_run(one, two)


def test_sbatch_on_two_slurm_nodes_takes_the_steps_of_one_node(nodes, one_node, tmp_path):
    with private_slurm(netns=(nodes[0][0], nodes[1][0])) as slurm:
        out = tmp_path / "run"
        job = slurm.sbatch("--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/job.out",
                           os.path.join(ROOT, "launch", "train_cpu.sbatch"), *PPO, "--save_path", str(out),
                           env={"JOB": "train_ppo", "MASTER_PORT": str(free_port())})
        info = slurm.wait(job)
    text = (tmp_path / "job.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "node[0-1]"), text[-4000:]
    assert_same_run(one_node, out)


def strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)}


def weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))
