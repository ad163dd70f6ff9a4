#!/usr/bin/env bash
# A one-node Slurm for the tests: munged + slurmctld + slurmd (Debian's slurm-wlm), all state,
# logs and the munge socket/key in one directory so nothing under /etc is touched.
#
#   tests/slurm/start_slurm.sh [start|stop|status] [DIR]
#
# DIR defaults to $MRL_SLURM_DIR or ${TMPDIR:-/tmp}/megatron-rl-slurm. `start` is idempotent: with the
# daemons of DIR already up it only waits for the node to be idle. It prints the slurm.conf path
# last; clients need `export SLURM_CONF=<that path>` (DIR/env holds that line). Runs as root
# (slurmd must, to start jobs as the submitting user). Ports: $MRL_SLURM_PORT (slurmctld, default
# 6817) and that + 1 (slurmd).
set -euo pipefail

ACTION=${1:-start}
DIR=${2:-${MRL_SLURM_DIR:-${TMPDIR:-/tmp}/megatron-rl-slurm}}
CTLD_PORT=${MRL_SLURM_PORT:-6817}
SLURMD_PORT=$((CTLD_PORT + 1))
CONF="$DIR/slurm.conf"
SOCKET="$DIR/munge/munge.socket"

die() { echo "start_slurm: error: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: the daemon whose pid is in PIDFILE is running
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop_daemon() {  # stop_daemon PIDFILE NAME: TERM, then KILL after 10 s
    local pidfile=$1 pid
    alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    rm -f "$pidfile"
}

write_config() {
    local node_line host
    # The node line exactly as slurmd sees this machine (CPUs, sockets, memory), minus UpTime.
    node_line=$(slurmd -C | head -n 1)
    [[ "$node_line" == NodeName=* ]] || die "'slurmd -C' printed no node line: $node_line"
    host=${node_line%% *}; host=${host#NodeName=}
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge" "$DIR/log"
    cat > "$CONF" <<CONF
# Written by tests/slurm/start_slurm.sh: one node, no accounting database, no cgroups.
ClusterName=megatron-rl-ci
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# linuxproc tracks a job's processes by parentage: the trainer's rollout server (its own session)
# is still killed with the job. No cgroup plugins: containers rarely delegate cgroups.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# Finished jobs stay visible to scontrol/squeue for an hour (no sacct without slurmdbd).
MinJobAge=3600
ReturnToService=2
KillWait=30
SlurmdTimeout=60
# One stand-in GPU (its "device" is /dev/null): a job may ask for --gpus-per-node as on a GPU
# cluster and Slurm sets CUDA_VISIBLE_DEVICES, while CUDA sees nothing. The tests check with it
# that a GPU job refuses to run on the CPU.
GresTypes=gpu
$node_line Gres=gpu:1
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    cat > "$DIR/gres.conf" <<CONF
AutoDetect=off
NodeName=$host Name=gpu File=/dev/null
CONF
    cat > "$DIR/cgroup.conf" <<'CONF'
# Unused (proctrack/linuxproc, task/none); present because slurmd looks for it beside slurm.conf.
CgroupPlugin=autodetect
CONF
    echo "export SLURM_CONF=$CONF" > "$DIR/env"
}

start_munge() {
    alive "$DIR/munge/munged.pid" && return 0
    chmod 700 "$DIR/munge"
    if [[ ! -s "$DIR/munge/munge.key" ]]; then
        mungekey --create --keyfile="$DIR/munge/munge.key" 2>/dev/null \
            || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none
    fi
    chmod 600 "$DIR/munge/munge.key"
    # --force: munged refuses root and group-writable parents (/tmp) otherwise; the key and socket
    # directory are private (mode 700) all the same.
    munged --force --key-file="$DIR/munge/munge.key" --socket="$SOCKET" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
        || die "munged did not start; see $DIR/log/munged.log"
}

wait_idle() {
    local state="" node
    node=$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$CONF")
    for _ in $(seq 150); do
        state=$(SLURM_CONF=$CONF sinfo -h -N -n "$node" -o %T 2>/dev/null | head -n 1) || true
        case "$state" in
            idle|mixed|allocated) return 0 ;;
            down*|drain*)  # left over from an earlier start: bring it back
                SLURM_CONF=$CONF scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.2
    done
    die "node $node not idle after 30 s (state: '${state:-no answer}'); see $DIR/log/slurmctld.log and slurmd.log"
}

start() {
    for tool in slurmctld slurmd munged sinfo; do
        command -v "$tool" >/dev/null || die "$tool not found; run tools/install_ci_system_deps.sh"
    done
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd starts jobs as their users)"
    [[ -f "$CONF" ]] || write_config
    start_munge
    if ! alive "$DIR/slurmctld.pid"; then
        slurmctld -f "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    fi
    if ! alive "$DIR/slurmd.pid"; then
        slurmd -f "$CONF" || die "slurmd did not start; see $DIR/log/slurmd.log"
    fi
    wait_idle
    echo "$CONF"
}

stop() {
    stop_daemon "$DIR/slurmd.pid"
    stop_daemon "$DIR/slurmctld.pid"
    stop_daemon "$DIR/munge/munged.pid"
}

case "$ACTION" in
    start) start ;;
    stop) stop ;;
    status) alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && alive "$DIR/munge/munged.pid" ;;
    *) die "unknown action '$ACTION' (allowed: start, stop, status)" ;;
esac
