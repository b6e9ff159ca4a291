#!/usr/bin/env bash
# Stop the local test cluster started by start.sh: cancel jobs, then SIGTERM each daemon by the PID in
# its pid file (SIGKILL after 15 s). Idempotent.
set -uo pipefail
. "$(dirname "$0")/daemons.sh"  # say, alive, stop_pid, stop_slurmds

if alive /run/slurmctld.pid slurmctld; then
  timeout 10 scancel --full --signal=KILL --state=RUNNING 2>/dev/null
  timeout 10 scancel --state=PENDING 2>/dev/null
fi
stop_slurmds
stop_pid /run/slurmctld.pid slurmctld
stop_pid /run/slurmdbd.pid slurmdbd
stop_pid /run/mysqld/mysqld.pid mariadbd
stop_pid /run/munge/munged.pid munged
say "stopped"
