#!/usr/bin/env bash
# A private single-host SLURM (slurmctld + slurmd + munged) for the launch tests (tests/slurm_cluster.py),
# everything under one state directory: nothing in /etc, /run or /var is used or changed.
#   bash launch/test_slurm_setup.sh install           # apt-get install slurm-wlm munge (needs root and apt)
#   bash launch/test_slurm_setup.sh start DIR [PORT]  # configure for this host and start; prints SLURM_CONF=...
#   bash launch/test_slurm_setup.sh start-netns DIR PORT NS0 NS1  # two nodes, node0 (10.77.0.1) and node1
#       (10.77.0.2), one slurmd in each of the network namespaces NS0 and NS1 (made by the caller with
#       `ip netns add`, addresses up, /etc/netns/NSi/hosts naming both), slurmctld in NS0 under hostname
#       node0; submit from NS0
#   bash launch/test_slurm_setup.sh stop DIR          # stop what `start DIR` started (safe to repeat)
# Clients then need SLURM_CONF=DIR/slurm.conf. The node has this host's CPU count and no GPUs; jobs run as
# the caller (root here), with proctrack/linuxproc and task/none, so no cgroups are needed. PORT (default
# 16817) is slurmctld's; slurmd takes PORT+1. Exit codes of `install`/`start`: 0 done, 3 cannot here (the
# reason on the last line of stderr, which the tests skip with), anything else a failure.
set -euo pipefail

cannot() { echo "cannot: $*" >&2; exit 3; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v srun >/dev/null; then
    return 0
  fi
  [ "$(id -u)" = 0 ] || cannot "slurm-wlm/munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || cannot "slurm-wlm/munge are not installed and there is no apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 || cannot "apt-get update failed (no network to the Debian mirror?)"
  # policy-rc.d or a missing init keeps the packages' own services from starting: we start ours below
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >&2 || cannot "apt-get install slurm-wlm munge failed"
}

start_munge() {
  local dir=$1
  for tool in slurmctld slurmd munged srun; do
    command -v "$tool" >/dev/null || cannot "$tool is not installed (run: $0 install)"
  done
  [ "$(id -u)" = 0 ] || cannot "slurmd must run as root to start jobs as their user"
  mkdir -p "$dir"/{munge,spool,state,log}
  dir=$(cd "$dir" && pwd)
  # slurmd's step sockets are DIR/spool/NODE/NODE_JOB.STEP (up to ~40 bytes more), and a unix socket path has
  # at most 107: a longer DIR lets the daemons start but no job step launch (the job goes back to PENDING)
  [ ${#dir} -le 60 ] || { echo "state directory $dir is ${#dir} bytes long; slurmd's sockets under it would pass the 107-byte limit of a unix socket path: use one of at most 60 (mktemp -d /tmp/slurm-XXXX)" >&2; exit 1; }
  chmod 700 "$dir/munge"
  [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; }
  chmod 400 "$dir/munge/munge.key"
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
    || cannot "munged does not start here: $(tail -n 3 "$dir/log/munged.log" 2>/dev/null | tr '\n' ' ')"
}

write_conf() {  # DIR PORT CTLD_HOST NODE_LINES
  local dir=$1 port=$2 ctld=$3 nodes=$4
  cat >"$dir/slurm.conf" <<EOF
ClusterName=rlhftest
SlurmctldHost=$ctld
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=600
SlurmdTimeout=30
$nodes
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

wait_idle() {  # DIR NODES [client prefix...]: every node registered with slurmctld
  local dir=$1 want=$2
  shift 2
  for _ in $(seq 60); do
    if [ "$("$@" sinfo -h -N -o '%T' 2>/dev/null | grep -cE '^(idle|mixed|allocated)')" = "$want" ]; then
      echo "SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.5
  done
  cannot "the nodes did not become idle in 30 s: $("$@" sinfo -N 2>&1 | tr '\n' ' ') $(tail -qn 3 "$dir"/log/slurm*.log | tr '\n' ' ')"
}

start() {
  local dir=$1 port=${2:-16817} host cpus
  start_munge "$dir"
  dir=$(cd "$dir" && pwd)
  host=$(hostname -s)
  cpus=$(nproc --all)
  write_conf "$dir" "$port" "$host" "NodeName=$host CPUs=$cpus State=UNKNOWN"
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF" || cannot "slurmctld does not start here: $(tail -n 3 "$dir/log/slurmctld.log" | tr '\n' ' ')"
  mkdir -p "$dir/spool/$host"
  slurmd -f "$SLURM_CONF" || cannot "slurmd does not start here: $(tail -n 3 "$dir/log/slurmd-$host.log" | tr '\n' ' ')"
  wait_idle "$dir" 1
}

in_node() {  # NS HOSTNAME CMD...: CMD in network namespace NS under its own hostname (a UTS namespace)
  # and with /etc/netns/NS/hosts as /etc/hosts. Not `ip netns exec`: it remounts /sys, without the cgroup
  # file system slurmd 22.05 insists on finding even with proctrack/linuxproc and task/none.
  local ns=$1 name=$2
  shift 2
  nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c \
    "mount --bind /etc/netns/$ns/hosts /etc/hosts && hostname $name && exec \"\$@\"" sh "$@"
}

start_netns() {
  local dir=$1 port=$2 ns0=$3 ns1=$4
  command -v nsenter >/dev/null && command -v unshare >/dev/null || cannot "start-netns needs nsenter and unshare"
  start_munge "$dir"  # its socket is a file: the daemons in both namespaces reach it
  dir=$(cd "$dir" && pwd)
  write_conf "$dir" "$port" "node0(10.77.0.1)" "NodeName=node0 NodeAddr=10.77.0.1 CPUs=1 State=UNKNOWN
NodeName=node1 NodeAddr=10.77.0.2 CPUs=1 State=UNKNOWN"
  export SLURM_CONF=$dir/slurm.conf
  mkdir -p "$dir/spool/node0" "$dir/spool/node1"
  in_node "$ns0" node0 slurmctld -f "$SLURM_CONF" || cannot "slurmctld does not start in $ns0"
  in_node "$ns0" node0 slurmd -f "$SLURM_CONF" -N node0 || cannot "slurmd does not start in $ns0"
  in_node "$ns1" node1 slurmd -f "$SLURM_CONF" -N node1 || cannot "slurmd does not start in $ns1"
  wait_idle "$dir" 2 nsenter --net="/run/netns/$ns0"
}

stop() {
  local dir=$1 pidfile pid
  for pidfile in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
  done
}

case "${1:-}" in
  install) install ;;
  start) start "${2:?state directory}" "${3:-}" ;;
  start-netns) start_netns "${2:?state directory}" "${3:?port}" "${4:?namespace 0}" "${5:?namespace 1}" ;;
  stop) stop "${2:?state directory}" ;;
  *) echo "usage: $0 install | start DIR [PORT] | start-netns DIR PORT NS0 NS1 | stop DIR" >&2; exit 2 ;;
esac
