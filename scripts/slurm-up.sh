#!/usr/bin/env bash
# Start a single-node SLURM cluster on this machine for the SLURM tests (tests/test_slurm.py).
#
# Needs root and a Debian/Ubuntu system; works without systemd (the daemons are started here, by
# hand). Installs the Debian packages slurmctld, slurmd, slurm-client and munge when slurmctld is
# missing, writes /etc/slurm/slurm.conf for one node (this host, all its CPUs, one partition
# "debug"), starts munged, slurmctld and slurmd with pid files under /run/slurm and /run/munge,
# and waits until the node is idle. Running it again restarts the daemons it started (by pid file)
# unless they are up with the same config. scripts/slurm-down.sh stops them.
#
# Settings for fast tests (see MEASURED.md "SLURM 22.05 from Debian packages"):
#   AuthInfo=cred_expire=5, SchedulerParameters=sched_interval=2,bf_interval=1
#     a requeued job runs again after 6-8 s instead of ~122 s;
#   JobRequeue=1 (jobs may be requeued), KillWait=10 (s from SIGTERM to SIGKILL), MinJobAge=600.
# Environment:
#   SLURM_PROCTRACK  cgroup | linuxproc | auto (default: cgroup where the cgroup v1 freezer is
#                    mounted, so SLURM also kills orphaned workers; else linuxproc)
#   SLURM_UP_TIMEOUT seconds to wait for the node to become idle (default 60)
# Prints the time each phase took; exits non-zero with the daemons' log tails when it fails.
set -euo pipefail

CONF_DIR=/etc/slurm
PID_DIR=/run/slurm
LOG_DIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
MUNGE_PID=/run/munge/munged.pid
TIMEOUT=${SLURM_UP_TIMEOUT:-60}

now_ms() { date +%s%3N; }
say() { echo "slurm-up: $*"; }
die() {
  echo "slurm-up: error: $*" >&2
  for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log"; do
    [ -f "$f" ] && { echo "--- tail of $f" >&2; tail -n 20 "$f" >&2; }
  done
  exit 1
}

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"
t_start=$(now_ms)

# ---- 1. packages ------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || die "slurmctld/slurmd/sbatch/munged are missing and there is no apt-get to install them"
  say "installing slurmctld slurmd slurm-client munge (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi
t_installed=$(now_ms)

# ---- 2. config --------------------------------------------------------------------------------
node=$(hostname -s)
cpus=$(nproc)
mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
mem_mb=$(( mem_mb > 2048 ? mem_mb - 1024 : mem_mb ))   # keep 1 GiB for the system
proctrack=${SLURM_PROCTRACK:-auto}
if [ "$proctrack" = auto ]; then
  if grep -qs ' /sys/fs/cgroup/freezer cgroup ' /proc/mounts; then proctrack=cgroup; else proctrack=linuxproc; fi
fi
case "$proctrack" in cgroup|linuxproc) ;; *) die "SLURM_PROCTRACK=$proctrack: expected cgroup, linuxproc or auto";; esac

mkdir -p "$CONF_DIR" "$PID_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"
new_conf=$(mktemp)
trap 'rm -f "$new_conf"' EXIT
cat > "$new_conf" <<EOF
# written by trainguard scripts/slurm-up.sh: one node, for tests
ClusterName=trainguard
SlurmctldHost=${node}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/${proctrack}
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}
SlurmctldPidFile=${PID_DIR}/slurmctld.pid
SlurmdPidFile=${PID_DIR}/slurmd.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=${node} CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
all_alive() { alive "$MUNGE_PID" && alive "$PID_DIR/slurmctld.pid" && alive "$PID_DIR/slurmd.pid"; }

if all_alive && cmp -s "$new_conf" "$CONF_DIR/slurm.conf" \
   && [ "$(sinfo -h -N -o %T 2>/dev/null | head -n1)" = idle ]; then
  say "already up with this config ($(sinfo -h -o '%P %D %T' | tr '\n' ' '))"
  exit 0
fi
cp "$new_conf" "$CONF_DIR/slurm.conf"
if [ "$proctrack" = cgroup ]; then
  cat > "$CONF_DIR/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
else
  rm -f "$CONF_DIR/cgroup.conf"
fi

# ---- 3. (re)start the daemons -----------------------------------------------------------------
bash "$(dirname "$0")/slurm-down.sh" >/dev/null
t_stopped=$(now_ms)

install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then   # the package's postinst normally creates it
  install -d -o munge -g munge -m 0700 /etc/munge
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
fi
runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID"
for _ in $(seq 100); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null 2>&1 || die "munged does not answer"
t_munge=$(now_ms)

/usr/sbin/slurmctld -i   # -i: ignore unreadable old state; daemonizes, writes its pid file
/usr/sbin/slurmd
deadline=$(( $(date +%s) + TIMEOUT ))
state=""
while [ "$(date +%s)" -lt "$deadline" ]; do
  state=$(sinfo -h -N -o %T 2>/dev/null | head -n1 || true)
  [ "$state" = idle ] && break
  case "$state" in down*|drain*) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true;; esac
  sleep 0.2
done
[ "$state" = idle ] || die "node $node is not idle after ${TIMEOUT} s (state: ${state:-no answer})"
t_idle=$(now_ms)

sinfo
say "timing: install $(( t_installed - t_start )) ms, stop old $(( t_stopped - t_installed )) ms," \
    "munge $(( t_munge - t_stopped )) ms, node idle $(( t_idle - t_munge )) ms, total $(( t_idle - t_start )) ms" \
    "(proctrack/$proctrack)"
