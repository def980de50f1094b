#!/bin/bash
# A one-machine SLURM for the tests: munge, slurmctld and one slurmd on this host,
# with as many CPUs as the machine has. Run as root; idempotent.
set -euo pipefail

if ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmd slurmctld slurm-client munge >/dev/null
fi
if sinfo -h -o %T 2>/dev/null | grep -q idle; then
  exit 0
fi

mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /etc/slurm
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chmod 400 /etc/munge/munge.key
chown -R root:root /etc/munge /var/lib/munge /var/log/munge /run/munge
pgrep -x munged >/dev/null || munged --force

host=$(hostname -s)
# slurmctld, slurmd and Lightning (from SLURM_NODELIST) all look this name up.
getent hosts "$host" >/dev/null || echo "127.0.0.1 $host" >> /etc/hosts
cpus=$(nproc)
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=litft-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -q idle; then exit 0; fi
  sleep 1
done
echo "slurm did not come up" >&2
tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
