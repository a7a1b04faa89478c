#!/usr/bin/env bash
# Start PostgreSQL and Redis on 127.0.0.1 when they are down; install them from Debian first when
# this machine has neither. Tests talk to these real servers.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

postgres_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
redis_up() { [ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = PONG ]; }

if ! command -v pg_ctlcluster >/dev/null || ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
  as_root apt-get update -q
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q postgresql
  # Tests connect as postgres over TCP without a password, as on the CI machines.
  for hba in /etc/postgresql/*/main/pg_hba.conf; do
    as_root sed -i -E 's/(scram-sha-256|md5|peer)$/trust/' "$hba"
  done
fi
if ! postgres_up; then
  as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  for _ in $(seq 50); do postgres_up && break; sleep 0.2; done
fi
postgres_up || { echo "PostgreSQL did not come up on 127.0.0.1:5432" >&2; exit 1; }
if ! psql -h 127.0.0.1 -U postgres -tAc "select 1 from pg_database where datname = 'test'" | grep -q 1; then
  psql -h 127.0.0.1 -U postgres -c "create database test"
fi

if ! command -v redis-server >/dev/null; then
  as_root apt-get update -q
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q redis-server
fi
if ! redis_up; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  for _ in $(seq 50); do redis_up && break; sleep 0.1; done
fi
redis_up || { echo "Redis did not come up on 127.0.0.1:6379" >&2; exit 1; }
echo "services: postgres and redis are up"
bash "$(dirname "$0")/redis8.sh"  # best effort: vector-set tests skip without it
