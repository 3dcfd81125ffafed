#!/usr/bin/env bash
# One machine's share of a PipelineRL run (docs/multinode.md): starts the documented commands
# for this node's roles, chosen from the scheduler's own variables, and waits for them.
#
#   usage: pipelinerl-node.sh RUN.yaml [overrides...]
#
# Layout, by node rank (0 .. NNODES-1):
#   node 0                          redis-server, and trainer node 0
#   nodes 0 .. TRAINER_NODES-1      the trainer: torchrun, GPUS_PER_NODE ranks on each
#   the other nodes                 ACTORS_PER_NODE actors each, ids numbered from 0 in node order
#   the last node, with EVALUATOR=1 the evaluator too
# RUN.yaml's actor.num_actors must be (NNODES - TRAINER_NODES) * ACTORS_PER_NODE.
#
# Where the variables come from (the first one set wins):
#   node rank   NODE_RANK, SLURM_NODEID, JOB_COMPLETION_INDEX (a Kubernetes indexed Job)
#   node count  NNODES, SLURM_NNODES
#   run id      RUN_ID, slurm-$SLURM_JOB_ID
#   head host   HEAD_HOST, else the first name of SLURM_JOB_NODELIST: `scontrol show
#               hostnames` expands it where scontrol exists; without scontrol (a stand-in,
#               tests/test_multinode.py) the list must be plain comma-separated names.
# The head host must be reachable from every node under that name: redis, the trainer's
# rendezvous and the weight store are there.
set -euo pipefail

CONFIG=${1:?usage: pipelinerl-node.sh RUN.yaml [overrides...]}
shift
OVERRIDES=("$@")

fail() { echo "pipelinerl-node.sh: $*" >&2; exit 2; }

NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-${JOB_COMPLETION_INDEX:-}}}
NNODES=${NNODES:-${SLURM_NNODES:-}}
# The prefix says where the id came from (a digits-only id is accepted too).
RUN_ID=${RUN_ID:-${SLURM_JOB_ID:+slurm-$SLURM_JOB_ID}}
[[ -n $NODE_RANK ]] || fail "no node rank: set NODE_RANK (Slurm sets SLURM_NODEID, an indexed Job JOB_COMPLETION_INDEX)"
[[ -n $NNODES ]] || fail "no node count: set NNODES (Slurm sets SLURM_NNODES)"
[[ -n $RUN_ID ]] || fail "no run id: set RUN_ID (Slurm's SLURM_JOB_ID is used where set)"

first_node() {
    local list=${SLURM_JOB_NODELIST:?set HEAD_HOST or SLURM_JOB_NODELIST}
    if command -v scontrol >/dev/null; then
        scontrol show hostnames "$list" | head -n 1
    elif [[ $list == *[* ]]; then
        fail "SLURM_JOB_NODELIST=$list needs scontrol to expand; set HEAD_HOST"
    else
        echo "${list%%,*}"
    fi
}
HEAD_HOST=${HEAD_HOST:-$(first_node)}

TRAINER_NODES=${TRAINER_NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
ACTORS_PER_NODE=${ACTORS_PER_NODE:-1}
EVALUATOR=${EVALUATOR:-0}
REDIS_PORT=${REDIS_PORT:-6379}
RDZV_PORT=${RDZV_PORT:-29400}
STORE_PORT=${STORE_PORT:-29500}
WAIT_S=${WAIT_S:-300}  # for redis on the head node, before an actor starts
(( NNODES > TRAINER_NODES )) || fail "NNODES=$NNODES leaves no node for actors after TRAINER_NODES=$TRAINER_NODES"
(( NODE_RANK < NNODES )) || fail "node rank $NODE_RANK is not below NNODES=$NNODES"

# Every role reads the same config with the same run id, Redis and weight store.
COMMON=(run_id="$RUN_ID" stream.backend=redis "stream.redis_url=redis://$HEAD_HOST:$REDIS_PORT/0"
        sync.backend=broadcast "sync.init_method=tcp://$HEAD_HOST:$STORE_PORT" "${OVERRIDES[@]}")

pids=()
stop_roles() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
trap stop_roles TERM INT  # Slurm's and Kubernetes' stop: every role stops as on Ctrl-C

say() { echo "node $NODE_RANK ($(hostname)): $*" >&2; }

start_redis() {
    say "redis-server on port $REDIS_PORT"
    redis-server --bind 0.0.0.0 --port "$REDIS_PORT" --protected-mode no --save '' \
        --appendonly no &
    REDIS_PID=$!
}

wait_for_redis() {
    local deadline=$((SECONDS + WAIT_S))
    until redis-cli -h "$HEAD_HOST" -p "$REDIS_PORT" ping >/dev/null 2>&1; do
        (( SECONDS < deadline )) || fail "no redis at $HEAD_HOST:$REDIS_PORT within $WAIT_S s"
        sleep 1
    done
}

start_trainer() {
    say "trainer node $NODE_RANK of $TRAINER_NODES, $GPUS_PER_NODE rank(s)"
    # The endpoint's own node hosts the rendezvous: torchrun would guess it from the host
    # name, which resolves to loopback on Debian and Ubuntu.
    torchrun --nnodes "$TRAINER_NODES" --nproc-per-node "$GPUS_PER_NODE" --rdzv-id "$RUN_ID" \
        --rdzv-backend c10d --rdzv-endpoint "$HEAD_HOST:$RDZV_PORT" \
        --rdzv-conf "is_host=$(( NODE_RANK == 0 ))" \
        -m pipelinerl.cli trainer "$CONFIG" "${COMMON[@]}" &
    pids+=($!)
}

start_actors() {
    local first=$(( (NODE_RANK - TRAINER_NODES) * ACTORS_PER_NODE )) i
    for (( i = first; i < first + ACTORS_PER_NODE; i++ )); do
        say "actor $i"
        pipelinerl actor "$CONFIG" "${COMMON[@]}" --actor-id "$i" &
        pids+=($!)
    done
    if (( EVALUATOR && NODE_RANK == NNODES - 1 )); then
        say "evaluator"
        pipelinerl evaluator "$CONFIG" "${COMMON[@]}" &
        pids+=($!)
    fi
}

# Redis outlives the trainer until the other roles have read its stop record and left.
stop_redis_when_alone() {
    local deadline=$((SECONDS + WAIT_S)) clients
    while (( SECONDS < deadline )); do
        clients=$(redis-cli -p "$REDIS_PORT" info clients | sed -n 's/^connected_clients:\([0-9]*\).*/\1/p')
        (( clients <= 1 )) && break
        sleep 1
    done
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
    wait "$REDIS_PID" || true
}

if (( NODE_RANK == 0 )); then
    start_redis
fi
wait_for_redis
if (( NODE_RANK < TRAINER_NODES )); then
    start_trainer
else
    start_actors
fi

status=0
for pid in "${pids[@]}"; do
    # A stop signal interrupts `wait` (its trap then runs): wait again until the role is gone.
    until wait "$pid"; do
        code=$?
        if ! kill -0 "$pid" 2>/dev/null; then status=$code; break; fi
    done
done
if (( NODE_RANK == 0 )); then
    stop_redis_when_alone
fi
say "done (exit $status)"
exit "$status"
