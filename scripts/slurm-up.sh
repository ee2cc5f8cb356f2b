#!/usr/bin/env bash
# Brings up a real single-node SLURM cluster on this machine for embedjob's tests
# (tests/test_slurm.py): munged, slurmctld and slurmd from Debian's packages, on
# 127.0.0.1, with all state, logs and PID files under $EMBEDJOB_SLURM_DIR.
#
# Needs root and apt (Debian/Ubuntu). Idempotent: a cluster this script started and that
# still answers is left as it is; anything else it started before is stopped first.
# Stop it with scripts/slurm-down.sh (same EMBEDJOB_SLURM_DIR).
#
# It writes /etc/slurm/slurm.conf (where SLURM's commands look for it) only if that file
# is absent or was written by this script, so it never replaces a real cluster's config.
set -euo pipefail

BASE=${EMBEDJOB_SLURM_DIR:-/tmp/embedjob-slurm}
CTLD_PORT=${EMBEDJOB_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${EMBEDJOB_SLURMD_PORT:-6818}
WAIT_S=${EMBEDJOB_SLURM_WAIT_S:-60}
CONF=/etc/slurm/slurm.conf
MARK="# embedjob test cluster (scripts/slurm-up.sh); state in"
HERE=$(cd "$(dirname "$0")" && pwd)
PACKAGES="slurmctld slurmd slurm-client munge"
start=$SECONDS

say() { echo "slurm-up: [$((SECONDS - start)) s] $*"; }
fail() {
  echo "slurm-up: error: $*" >&2
  for log in "$BASE/slurmctld.log" "$BASE/slurmd.log"; do
    if [ -f "$log" ]; then echo "--- last lines of $log" >&2; tail -n 15 "$log" >&2; fi
  done
  exit 1
}
# wait_until <what> <command...>: poll until the command succeeds or WAIT_S pass.
wait_until() {
  local what=$1 deadline=$((SECONDS + WAIT_S))
  shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || fail "gave up waiting for $what after ${WAIT_S} s"
    sleep 0.2
  done
}
alive() { [ -s "$BASE/$1.pid" ] && kill -0 "$(cat "$BASE/$1.pid")" 2>/dev/null; }
controller_up() { timeout 10 scontrol ping 2>/dev/null | grep -q "is UP"; }
node_ready() { timeout 10 sinfo -h -n "$NODE" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

[ "$(id -u)" = 0 ] || fail "must run as root (it installs packages and starts daemons)"
command -v apt-get >/dev/null || fail "needs apt-get (Debian or Ubuntu)"
NODE=$(hostname -s)

if alive slurmctld && alive slurmd && controller_up && node_ready; then
  say "already up (node $NODE, state in $BASE)"
  exit 0
fi
if ls "$BASE"/*.pid >/dev/null 2>&1; then
  say "stopping the remains of an earlier start"
  EMBEDJOB_SLURM_DIR=$BASE bash "$HERE/slurm-down.sh"
fi

# 1. Packages. Without recommends this is 8 small packages. A policy-rc.d keeps their
# maintainer scripts from starting daemons we would then not own.
need_install=0
for bin in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sbatch /usr/sbin/munged; do
  [ -x "$bin" ] || need_install=1
done
if [ $need_install = 1 ]; then
  policy=/usr/sbin/policy-rc.d
  made_policy=0
  if [ ! -e $policy ]; then
    printf '#!/bin/sh\nexit 101\n' > $policy && chmod 0755 $policy
    made_policy=1
    trap 'rm -f '"$policy" EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt_install() { apt-get install -y -q -o DPkg::Lock::Timeout=300 --no-install-recommends $PACKAGES >/dev/null; }
  # Package lists are often present already; fetch them only when the install needs it.
  if ! apt_install 2>/dev/null; then
    apt-get update -q >/dev/null
    apt_install
  fi
  if [ $made_policy = 1 ]; then rm -f $policy; trap - EXIT; fi
  say "installed $PACKAGES"
fi

# 2. Our config file, and free ports.
if [ -e $CONF ] && ! grep -qF "$MARK" $CONF; then
  fail "$CONF exists and was not written by this script; refusing to replace a real cluster's config"
fi
for port in "$CTLD_PORT" "$SLURMD_PORT"; do
  if port_in_use "$port"; then fail "port $port is in use (another SLURM?); set EMBEDJOB_SLURMCTLD_PORT/EMBEDJOB_SLURMD_PORT"; fi
done

# 3. munge: SLURM authenticates every message with it. A munged that already answers
# is used as it is and left running by slurm-down.sh.
mkdir -p "$BASE"
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key
chmod 0600 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  say "using the munged that is already running"
else
  runuser -u munge -- /usr/sbin/munged --force
  wait_until munged sh -c 'munge -n </dev/null | unmunge'
  cp /run/munge/munged.pid "$BASE/munged.pid"
  say "munged started"
fi

# 4. slurm.conf for this one node. Hardware from `slurmd -C`; memory 5% below it so the
# node is not drained for having less than configured. No cgroups (containers have
# none): processes are tracked through /proc. cred_expire=10 lets a requeued task
# restart after ~13 s instead of two minutes; MinJobAge keeps finished tasks visible to
# `scontrol show job` (what `embedjob status` asks) for an hour.
rm -rf "$BASE/state" "$BASE/spool" "$BASE"/*.log
mkdir -p "$BASE/state" "$BASE/spool" /etc/slurm
hw=$(slurmd -C | head -n 1)
hw_field() { tr ' ' '\n' <<<"$hw" | sed -n "s/^$1=//p"; }
memory=$(($(hw_field RealMemory) * 95 / 100))
cat > $CONF <<EOF
$MARK $BASE
ClusterName=embedjob-test
SlurmctldHost=${NODE}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation=${BASE}/state
SlurmdSpoolDir=${BASE}/spool
SlurmctldPidFile=${BASE}/slurmctld.pid
SlurmdPidFile=${BASE}/slurmd.pid
SlurmctldLogFile=${BASE}/slurmctld.log
SlurmdLogFile=${BASE}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=3600
InactiveLimit=0
KillWait=5
NodeName=${NODE} NodeAddr=127.0.0.1 NodeHostname=${NODE} CPUs=$(hw_field CPUs) Boards=$(hw_field Boards) SocketsPerBoard=$(hw_field SocketsPerBoard) CoresPerSocket=$(hw_field CoresPerSocket) ThreadsPerCore=$(hw_field ThreadsPerCore) RealMemory=${memory} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

# 5. Daemons: both fork into the background and write the PID files named above.
/usr/sbin/slurmctld
wait_until slurmctld controller_up
/usr/sbin/slurmd
wait_until "node $NODE" node_ready
say "up: node $NODE ($(hw_field CPUs) CPUs, ${memory} MB), partition debug, state in $BASE"
