#!/usr/bin/env bash
# Stop the single-node SLURM cluster started by scripts/slurm-up.sh: slurmd, slurmctld, munged,
# each by its pid file (SIGTERM, up to 10 s, then SIGKILL). Daemons without a pid file, or whose
# pid file names a dead process, are left alone. Job state is kept in /var/spool/slurmctld.
set -euo pipefail

stop() {  # stop NAME PIDFILE
  local name=$1 pidfile=$2 pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "slurm-down: $name (pid $pid) did not stop after 10 s; SIGKILL"
      kill -9 "$pid" 2>/dev/null || true
    fi
    echo "slurm-down: stopped $name (pid $pid)"
  fi
  rm -f "$pidfile"
}

stop slurmd /run/slurm/slurmd.pid
stop slurmctld /run/slurm/slurmctld.pid
stop munged /run/munge/munged.pid
