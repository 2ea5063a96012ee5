#!/usr/bin/env bash
# Start a mindmoe-launch job on every node of a cluster over ssh: node i of HOSTS gets
# launch.node_rank=i, the first host is the msrun scheduler (launch.master_addr).
#
#   HOSTS="10.0.0.1 10.0.0.2 10.0.0.3 10.0.0.4" PROCS_PER_NODE=8 RUN_DIR=/shared/runs/glm45 \
#     launch/cluster.sh recipe=pretrain_tiny data.global_batch_size=512 train.max_steps=10000
#
# Environment: HOSTS (required, space-separated, node 0 first), RUN_DIR (required, a directory every
# node sees), PROCS_PER_NODE (default 8), MASTER_PORT (default 8118), WORKDIR (directory to cd into
# on each node; default: this one), SETUP (shell line run first on each node, e.g. sourcing the
# Ascend toolkit's set_env.sh and activating the Python environment), MINDMOE_SSH (default: ssh).
# Any further arguments are Hydra overrides, passed unchanged to every node.
set -euo pipefail

: "${HOSTS:?set HOSTS to the node addresses, node 0 first}"
: "${RUN_DIR:?set RUN_DIR to a run directory on a filesystem shared by all nodes}"
PROCS_PER_NODE="${PROCS_PER_NODE:-8}"
MASTER_PORT="${MASTER_PORT:-8118}"
WORKDIR="${WORKDIR:-$PWD}"
SETUP="${SETUP:-true}"
SSH="${MINDMOE_SSH:-ssh}"

read -r -a hosts <<< "$HOSTS"
master="${hosts[0]}"
overrides=$(printf '%q ' "$@")
pids=()
for node_rank in "${!hosts[@]}"; do
  host="${hosts[$node_rank]}"
  $SSH "$host" "$SETUP && cd $(printf '%q' "$WORKDIR") && mindmoe-launch launch.nodes=${#hosts[@]} \
launch.node_rank=$node_rank launch.procs_per_node=$PROCS_PER_NODE launch.master_addr=$master \
launch.master_port=$MASTER_PORT hydra.run.dir=$(printf '%q' "$RUN_DIR") $overrides" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"
