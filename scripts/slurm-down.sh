#!/usr/bin/env bash
# Stops the test cluster that scripts/slurm-up.sh started: cancels the jobs it still
# runs, then stops slurmd, slurmctld and (if slurm-up.sh started it) munged by the PIDs
# recorded under $EMBEDJOB_SLURM_DIR, and removes the slurm.conf it wrote. Processes
# are matched by PID and name, never killed by name alone. Safe to run when nothing runs.
set -uo pipefail

BASE=${EMBEDJOB_SLURM_DIR:-/tmp/embedjob-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# embedjob test cluster (scripts/slurm-up.sh); state in"

# stop <name>: TERM the PID in $BASE/<name>.pid if it is still <name>, KILL after 30 s.
stop() {
  local name=$1 file="$BASE/$1.pid" pid
  [ -s "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
    kill -TERM "$pid"
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "slurm-down: $name ($pid) ignored TERM; killing it"
      kill -KILL "$pid"
    fi
    echo "slurm-down: stopped $name ($pid)"
  fi
  rm -f "$file"
}

# Cancel first, so no job step outlives the daemons that track it.
if [ -s "$BASE/slurmctld.pid" ] && kill -0 "$(cat "$BASE/slurmctld.pid")" 2>/dev/null; then
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086  # one argument per job id
    timeout 10 scancel $jobs
    for _ in $(seq 100); do [ -z "$(timeout 5 squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
stop slurmd
stop slurmctld
stop munged
if [ -f $CONF ] && grep -qF "$MARK" $CONF; then rm -f $CONF; fi
exit 0
