# Shared by start.sh and stop.sh (sourced): find and stop the cluster's daemons by their pid files.
say() { echo "slurm-cluster: $*" >&2; }

# Alive = the pid file names a process that exists, is not a zombie (PID 1 here reaps lazily) and has
# the expected command name.
alive() {  # alive PIDFILE COMM
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1  # the daemon may remove it as it exits
  [ -r "/proc/$pid/status" ] || return 1
  grep -q '^State:.*Z' "/proc/$pid/status" && return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

stop_pid() {  # stop_pid PIDFILE COMM: SIGTERM, SIGKILL after 15 s; removes the pid file
  if alive "$1" "$2"; then
    local pid; pid=$(cat "$1")
    say "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 75); do alive "$1" "$2" || break; sleep 0.2; done
    if alive "$1" "$2"; then say "$2 ignored SIGTERM; SIGKILL"; kill -9 "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$1"
}

stop_slurmds() {  # every slurmd of the emulated nodes (and the single one of an older config)
  local pidfile
  for pidfile in /run/slurmd-*.pid /run/slurmd.pid; do [ -e "$pidfile" ] && stop_pid "$pidfile" slurmd; done
  return 0
}
