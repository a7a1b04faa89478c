#!/usr/bin/env bash
# A Redis 8 (vector sets) on 127.0.0.1:6380 for the response cache's vector-set tests, beside the Redis 7
# of .ci/services.sh. Debian stable before trixie has no Redis 8 package, so this unpacks trixie's
# (redis-tools holds the server binary) with the runtime libraries it needs into a cache directory and runs
# it through trixie's own dynamic loader: nothing is installed system-wide. Best effort: when the packages
# cannot be fetched or the server does not start, it says so and exits 0; those tests then skip, saying why.
set -uo pipefail

PORT=${REDIS8_PORT:-6380}
DIR=${SLUICE_REDIS8_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/redis8}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=(redis-tools libc6 libstdc++6 libgcc-s1 libatomic1 libjemalloc2 liblzf1 libssl3t64)
LIBS=$DIR/root/usr/lib/x86_64-linux-gnu
SERVER=$DIR/root/usr/bin/redis-server

up() { [ "$(redis-cli -h 127.0.0.1 -p "$PORT" VCARD sluice:probe 2>/dev/null)" = 0 ]; }
give_up() { echo "redis 8: not available ($1); the cache's vector-set tests will skip"; exit 0; }

up && { echo "redis 8: up on port $PORT"; exit 0; }
[ "$(uname -m)" = x86_64 ] || give_up "only x86_64 packages are fetched"
if [ ! -x "$DIR/root/usr/bin/redis-check-rdb" ]; then
  mkdir -p "$DIR/debs" || give_up "cannot create $DIR"
  index=$(curl -fsS -m 60 "$MIRROR/dists/trixie/main/binary-amd64/Packages.xz" | xz -dc) \
    || give_up "cannot fetch the trixie package index from $MIRROR"
  for package in "${PACKAGES[@]}"; do
    file=$(awk -v p="Package: $package" '$0 == p {found = 1} found && /^Filename:/ {print $2; exit}' <<<"$index")
    [ -n "$file" ] || give_up "no $package in trixie"
    curl -fsS -m 120 -o "$DIR/debs/${file##*/}" "$MIRROR/$file" || give_up "cannot fetch $file"
    dpkg-deb -x "$DIR/debs/${file##*/}" "$DIR/root" || give_up "cannot unpack ${file##*/}"
  done
fi
# The server is redis-check-rdb under another name: it picks its role from argv[0].
ln -sf redis-check-rdb "$SERVER"
"$LIBS/ld-linux-x86-64.so.2" --library-path "$LIBS" "$SERVER" --daemonize yes --bind 127.0.0.1 --port "$PORT" \
  --save "" --appendonly no --dir "$DIR" --logfile "$DIR/redis.log" || give_up "the server did not start"
for _ in $(seq 50); do up && break; sleep 0.1; done
up || give_up "nothing answers VCARD on port $PORT (see $DIR/redis.log)"
echo "redis 8: up on port $PORT"
