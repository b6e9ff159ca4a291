#!/usr/bin/env bash
# Stop the local test cluster started by start.sh: cancel jobs, then SIGTERM each daemon by the PID in
# its pid file (SIGKILL after 15 s). Idempotent.
set -uo pipefail
say() { echo "slurm-cluster: $*" >&2; }

alive() {  # alive PIDFILE COMM (a zombie counts as dead)
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1")
  [ -r "/proc/$pid/status" ] || return 1
  grep -q '^State:.*Z' "/proc/$pid/status" && return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

stop_pid() {  # stop_pid PIDFILE COMM
  if alive "$1" "$2"; then
    local pid; pid=$(cat "$1")
    say "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null
    for _ in $(seq 75); do alive "$1" "$2" || break; sleep 0.2; done
    alive "$1" "$2" && { say "$2 ignored SIGTERM; SIGKILL"; kill -9 "$pid" 2>/dev/null; }
  fi
  rm -f "$1"
}

if alive /run/slurmctld.pid slurmctld; then
  timeout 10 scancel --full --signal=KILL --state=RUNNING 2>/dev/null
  timeout 10 scancel --state=PENDING 2>/dev/null
fi
stop_pid /run/slurmd.pid slurmd
stop_pid /run/slurmctld.pid slurmctld
stop_pid /run/slurmdbd.pid slurmdbd
stop_pid /run/mysqld/mysqld.pid mariadbd
stop_pid /run/munge/munged.pid munged
say "stopped"
