#!/bin/sh
# N replicas of `qflash serve` behind nginx on one host (least_conn, failover; see README.md here).
#   deploy/replicas.sh [--gpu-each] N FRONT_PORT FIRST_PORT DIR -- SERVE_ARGS...
# starts replica i on FIRST_PORT + i (--gpu-each: on GPU i alone, by CUDA_VISIBLE_DEVICES), nginx
# on FRONT_PORT, writes DIR/nginx.conf, the logs and the pids (DIR/pids), and waits. Stopping it
# (SIGTERM / SIGINT) stops every replica and nginx. QFLASH: the binary (default: qflash on PATH).
set -eu
GPU_EACH=0
if [ "${1:-}" = "--gpu-each" ]; then GPU_EACH=1; shift; fi
[ $# -ge 5 ] && [ "$5" = "--" ] || { echo "usage: $0 [--gpu-each] N FRONT_PORT FIRST_PORT DIR -- SERVE_ARGS..." >&2; exit 2; }
N=$1 FRONT=$2 FIRST=$3 DIR=$4
shift 5
HERE=$(cd "$(dirname "$0")" && pwd)
QFLASH=${QFLASH:-qflash}
mkdir -p "$DIR"
: >"$DIR/pids"
UP=""
i=0
while [ "$i" -lt "$N" ]; do
    PORT=$((FIRST + i))
    GPU=""
    [ "$GPU_EACH" = 1 ] && GPU="CUDA_VISIBLE_DEVICES=$i"
    env $GPU "$QFLASH" serve --host 127.0.0.1 --port "$PORT" "$@" 2>"$DIR/replica-$i.log" &
    echo $! >>"$DIR/pids"
    UP="$UP server 127.0.0.1:$PORT max_fails=1 fail_timeout=10s;"
    i=$((i + 1))
done
sed -e "s|@LISTEN@|$FRONT|" -e "s|@UPSTREAMS@|$UP|" -e "s|@PREFIX@|$DIR|g" "$HERE/nginx.conf.in" >"$DIR/nginx.conf"
nginx -c "$DIR/nginx.conf" -p "$DIR" -e "$DIR/error.log" &
echo $! >>"$DIR/pids"
trap 'kill $(cat "$DIR/pids") 2>/dev/null; wait' TERM INT
wait
