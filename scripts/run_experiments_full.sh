#!/usr/bin/env bash
# Run the five `attnlab experiment` reproductions side by side, pack each run's folder,
# and (optionally) the MiniLM distillation at a few settings.
#
# Usage (from the repository root):
#   scripts/run_experiments_full.sh OUT_DIR [extra experiment flags, e.g. --quick]
#
# Each experiment runs in its own process (the trainer's device "auto" takes CUDA where
# there is one); `recall` runs one process per architecture (recall.run(kinds=...)) and
# combines them (recall.combine). Every process is capped at $EXPERIMENT_TIMEOUT seconds
# (default 420). OUT_DIR receives one NAME.tar.gz per experiment (results.md,
# results.json, plots, run.log with its stderr, each trained model's metrics.jsonl;
# checkpoints left out) and summary.txt (the machine, each process's exit status and
# seconds, and the distillation figures): six files. With $DISTILL_TEACHER set (a
# sentence-transformers folder, whose weights may be stored as model.fp16.safetensors to
# travel light: they are widened back to float32 first), `attnlab distill` runs the
# settings in $DISTILL_RUNS (one per line) one after the other beside the experiments,
# all within the one cap.
# $EXPERIMENTS (space-separated) picks some of extrapolation, selective-copy, gqa and
# induction; RECALL=0 leaves recall out. Prepared for a GPU machine and not yet run on
# one: the runs in docs/experiments.md were made on the 2-core CPU, one command each.
set -u -o pipefail

out=${1:?usage: scripts/run_experiments_full.sh OUT_DIR [experiment flags]}
shift
mkdir -p "$out"
work=$(mktemp -d)
read -r -a names <<<"${EXPERIMENTS-extrapolation selective-copy gqa induction}"
kinds=("attention" "linear attention" "mamba" "rwkv" "retnet")
[ "${RECALL:-1}" = 0 ] && kinds=()
cap=${EXPERIMENT_TIMEOUT:-420}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
py=${PYTHON:-python3}
summary="$work/summary.txt"
began=$(date +%s)

{
    date -u
    echo "cores: $(nproc), cap: ${cap}s, flags: $*"
    "$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
} >"$summary" 2>&1

timed() { # NAME FOLDER COMMAND...: run capped, log to FOLDER/run.log, status to $work/NAME.status
    local name=$1 folder=$2 start rc
    shift 2
    mkdir -p "$folder"
    start=$(date +%s)
    timeout "$cap" "$@" >"$folder/stdout.txt" 2>"$folder/run.log"
    rc=$?
    echo "exit $rc after $(($(date +%s) - start)) s" | tee -a "$folder/run.log" >"$work/$name.status"
}
pack() { # NAME: tar $work/NAME into OUT_DIR
    tar -C "$work" --exclude='checkpoints' --exclude='*.safetensors' --exclude='*.pt' \
        -czf "$out/$1.tar.gz" "$1"
}

pids=()
for name in "${names[@]}"; do
    (
        timed "$name" "$work/$name" "$py" -m attnlab.cli experiment "$name" --json \
            --out "$work/$name" "$@"
        pack "$name"
    ) &
    pids+=($!)
done
quick=False
for a in "$@"; do [ "$a" = --quick ] && quick=True; done
rpids=()
for kind in "${kinds[@]}"; do
    slug=${kind// /-}
    timed "recall-$slug" "$work/recall/$slug" "$py" -c '
import sys
from pathlib import Path
import torch
from attnlab.experiments import recall
from attnlab.experiments._common import write_result
torch.set_num_threads(1)
kind, out, quick = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "True"
if quick and kind not in recall._settings(True, False)["kinds"]:
    sys.exit(0)
write_result(recall.run(quick=quick, out=out, kinds=(kind,), progress=False), out)
' "$kind" "$work/recall/$slug" "$quick" &
    rpids+=($!)
done
recall_done() { # combine the per-architecture runs into one result, and pack them
    "$py" -c '
import sys
from pathlib import Path
from attnlab.experiments.recall import combine
parts = [p for p in sys.argv[2:] if (Path(p) / "results.json").is_file()]
r = combine([Path(p) for p in parts], Path(sys.argv[1]))
print(r.verdict)
' "$work/recall" "$work"/recall/*/ >"$work/recall/combine.txt" 2>&1
    for kind in "${kinds[@]}"; do
        echo "recall $kind: $(cat "$work/recall-${kind// /-}.status")"
    done >"$work/recall.status"
    pack recall
}

if [ -n "${DISTILL_TEACHER:-}" ]; then
    (
        teacher=$DISTILL_TEACHER
        if [ -f "$teacher/model.fp16.safetensors" ] && [ ! -f "$teacher/model.safetensors" ]; then
            wide=$work/teacher
            cp -r "$teacher" "$wide"
            "$py" -c '
import sys
from safetensors.torch import load_file, save_file
w = load_file(sys.argv[1] + "/model.fp16.safetensors")
save_file({k: v.float() if v.is_floating_point() else v for k, v in w.items()}, sys.argv[1] + "/model.safetensors")
' "$wide" && rm "$wide/model.fp16.safetensors"
            teacher=$wide
        fi
        while read -r flags; do
            [ -z "$flags" ] && continue
            start=$(date +%s)
            left=$((cap - (start - began)))  # the runs share one cap
            if [ "$left" -lt 60 ]; then echo "distill $flags: skipped, ${left}s left"; continue; fi
            # shellcheck disable=SC2086 # flags are words on purpose
            r=$(OMP_NUM_THREADS=2 timeout "$left" "$py" -m attnlab.cli distill --teacher "$teacher" \
                --json $flags 2>>"$work/distill.log" | tr -d '\n ')
            echo "distill $flags ($(($(date +%s) - start)) s): ${r:-failed, see below}"
        done <<<"${DISTILL_RUNS:-}" >"$work/distill.status"
    ) &
    pids+=($!)
fi

if [ ${#kinds[@]} -gt 0 ]; then
    for p in "${rpids[@]}"; do wait "$p"; done
    recall_done
fi
for p in "${pids[@]}"; do wait "$p"; done
{
    for name in "${names[@]}"; do echo "$name: $(cat "$work/$name.status")"; done
    cat "$work/recall.status" "$work/recall/combine.txt" 2>/dev/null
    cat "$work/distill.status" 2>/dev/null
    tail -n 20 "$work/distill.log" 2>/dev/null
} >>"$summary"
cp "$summary" "$out/summary.txt"
cat "$out/summary.txt"
rm -rf "$work"
