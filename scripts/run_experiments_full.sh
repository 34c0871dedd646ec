#!/usr/bin/env bash
# Run the five `attnlab experiment` reproductions side by side and pack each run's folder.
#
# Usage (from the repository root):
#   scripts/run_experiments_full.sh OUT_DIR [extra experiment flags, e.g. --quick]
#
# Each experiment runs in its own process (the trainer's device "auto" takes CUDA where
# there is one), with a share of the CPU threads, under a wall-clock cap of
# $EXPERIMENT_TIMEOUT seconds (default 420). OUT_DIR receives one NAME.tar.gz per
# experiment (its results.md, results.json, plots, run.log with its stderr, and each
# trained model's metrics.jsonl; checkpoints are left out), env.txt (the machine) and
# summary.txt (each experiment's exit status and seconds): seven files in all.
# Used for the GPU runs recorded in docs/experiments.md.
set -u -o pipefail

out=${1:?usage: scripts/run_experiments_full.sh OUT_DIR [experiment flags]}
shift
mkdir -p "$out"
work=$(mktemp -d)
names=(extrapolation recall selective-copy gqa induction)
cores=$(nproc)
threads=$(((cores + ${#names[@]} - 1) / ${#names[@]}))
cap=${EXPERIMENT_TIMEOUT:-420}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
py=${PYTHON:-python3}

{
    date -u
    uname -m
    echo "cores: $cores, threads per experiment: $threads, cap: ${cap}s"
    "$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
} >"$out/env.txt" 2>&1

pids=()
for name in "${names[@]}"; do
    (
        start=$(date +%s)
        mkdir -p "$work/$name"
        timeout "$cap" "$py" -m attnlab.cli experiment "$name" --json --out "$work/$name" "$@" \
            >"$work/$name.json" 2>"$work/$name/run.log"
        rc=$?
        echo "exit $rc after $(($(date +%s) - start)) s" | tee -a "$work/$name/run.log" \
            >"$work/$name.status"
        tar -C "$work" --exclude='checkpoints' --exclude='*.safetensors' --exclude='*.pt' \
            -czf "$out/$name.tar.gz" "$name"
    ) &
    pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for name in "${names[@]}"; do echo "$name: $(cat "$work/$name.status")"; done | tee "$out/summary.txt"
rm -rf "$work"
exit $status
