#!/usr/bin/env bash
# Start, join or wait for a Ray cluster: the bootstrap the Slurm recipe runs on every node.
#
#   ray_cluster.sh head   HEAD_IP PORT [ray start flags...]   start the head node, block
#   ray_cluster.sh worker HEAD_IP PORT NODE_IP [flags...]      join as NODE_IP, block
#   ray_cluster.sh wait   HEAD_IP PORT NODES TIMEOUT_S         until NODES nodes are alive
#
# `head` and `worker` stay in the foreground (`ray start --block`) so that srun or a test owns
# them: ending the step ends the node. `wait` exits 0 once the cluster has NODES alive nodes,
# printing their addresses as a joining driver sees them, 1 after TIMEOUT_S with the count it
# saw. Molt then joins with --train.ray_address HEAD_IP:PORT.
set -euo pipefail

usage() { sed -n '2,11p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
role=$1 head_ip=$2 port=$3
shift 3

# On SIGTERM a node first asks the GCS to mark it draining (for Ray Serve's proxies, which Molt
# does not use) and waits up to this long for the answer. When a job ends, Slurm signals every
# process of the step, the GCS among them, so the head waited out the whole 30 s default
# (longer than Slurm's default KillWait before its SIGKILL): 0 ends a node at once.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}

case $role in
  head)
    exec ray start --head --node-ip-address "$head_ip" --port "$port" \
      --include-dashboard false --disable-usage-stats --block "$@"
    ;;
  worker)
    [[ $# -ge 1 ]] || usage
    node_ip=$1
    shift
    exec ray start --address "$head_ip:$port" --node-ip-address "$node_ip" \
      --disable-usage-stats --block "$@"
    ;;
  wait)
    [[ $# -eq 2 ]] || usage
    nodes=$1 timeout_s=$2
    deadline=$((SECONDS + timeout_s))
    seen=0
    while ((SECONDS < deadline)); do
      alive=$(timeout 60 python3 - "$head_ip:$port" <<'PY' 2>/dev/null || true
import sys

import ray

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(" ".join(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])))
PY
)
      seen=$(wc -w <<< "$alive")
      if ((seen >= nodes)); then
        echo "ray cluster at $head_ip:$port: $seen nodes alive: $alive"
        exit 0
      fi
      sleep 2
    done
    echo "ray cluster at $head_ip:$port: $seen of $nodes nodes alive after ${timeout_s} s" >&2
    exit 1
    ;;
  *) usage ;;
esac
