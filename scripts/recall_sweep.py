"""The full ``recall`` sweep as one process per (model, width, learning rate), in an order
that can be cut: every model at the reference width 64 at every rate first (the verdict
reads only that width), then widths 32 and 128 at each model's rate chosen at width 64 (on
validation rows), then the other rates there. No job starts after ``--deadline``; the parts
done are combined into one result (``recall.combine``), and a cell or rate not run is said
so in the table (``—``) and in ``sweep.jsonl``.

Usage (from the repository root; the jobs are niced and single-threaded):
    python scripts/recall_sweep.py --out runs/recall-full [--workers 2] [--deadline 17:45]
    python scripts/recall_sweep.py --out runs/recall-full --combine-only

``--plan FILE`` (a JSON list of ``[model, width, rate]``) runs those jobs only, in that
order: the cut recorded in docs/experiments.md when the whole sweep does not fit.

Each job's wall and CPU seconds (its process's rusage) are appended to ``OUT/sweep.jsonl``;
a job whose ``results.json`` exists is not rerun (a stopped sweep resumes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from attnlab.experiments import recall

JOB = (
    "import sys, torch; torch.set_num_threads(1); from pathlib import Path; "
    "from attnlab.experiments import recall; "
    "from attnlab.experiments._common import write_result; "
    "out = Path(sys.argv[1]); "
    "r = recall.run(out=out, kinds=[sys.argv[2]], widths=[int(sys.argv[3])], "
    "lrs=[float(sys.argv[4])], seed=int(sys.argv[5]), progress=False); "
    "write_result(r, out)"
)
REF = 64


def _folder(out: Path, kind: str, width: int, lr: float) -> Path:
    return out / "parts" / f"{kind.replace(' ', '-')}-{width}-lr{lr:g}"


def _validation(folder: Path, kind: str, width: int, lr: float) -> float | None:
    f = folder / "results.json"
    if not f.exists():
        return None
    sweep = json.loads(f.read_text())["settings"]["sweep"]
    return float(sweep[kind][str(width)][f"{lr:g}"]["validation"])


def _next_job(out: Path, pending: list[tuple[str, int, float]]) -> tuple[str, int, float] | None:
    """The first pending job of the lowest phase whose inputs are known."""
    best: dict[str, float] = {}
    for kind in {k for k, _, _ in pending} | set(recall._settings(False, False)["kinds"]):
        vals = {lr: _validation(_folder(out, kind, REF, lr), kind, REF, lr) for lr in recall.LRS}
        if all(v is not None for v in vals.values()):
            best[kind] = max(recall.LRS, key=lambda x: vals[x] or 0.0)
    phase1 = [j for j in pending if j[1] == REF]
    phase2 = [j for j in pending if j[1] != REF and best.get(j[0]) == j[2]]
    phase3 = [j for j in pending if j[1] != REF and j[0] in best and best[j[0]] != j[2]]
    for phase in (phase1, phase2, phase3):
        if phase:
            return phase[0]
    return None


def sweep(
    out: Path, workers: int, deadline: dt.datetime | None, seed: int, plan: Path | None
) -> None:
    s = recall._settings(False, False)
    jobs = [(k, w, lr) for k in s["kinds"] for w in (REF, 32, 128) for lr in s["lrs"]]
    if plan is not None:
        jobs = [(str(k), int(w), float(lr)) for k, w, lr in json.loads(plan.read_text())]
    # a job with a run.log was started (by this or an earlier driver): not started again
    pending = [j for j in jobs if not (_folder(out, *j) / "run.log").exists()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    running: dict[int, tuple[subprocess.Popen[bytes], tuple[str, int, float], float]] = {}
    log = out / "sweep.jsonl"
    while pending or running:
        late = deadline is not None and dt.datetime.now(dt.UTC) >= deadline
        while len(running) < workers and pending and not late:
            job = pending[0] if plan is not None else _next_job(out, pending)
            if job is None:
                break
            pending.remove(job)
            folder = _folder(out, *job)
            folder.mkdir(parents=True, exist_ok=True)
            cmd = ["nice", "-n", "19", sys.executable, "-c", JOB, str(folder), job[0],
                   str(job[1]), repr(job[2]), str(seed)]  # fmt: skip
            with open(folder / "run.log", "wb") as err:
                p = subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT)
            running[p.pid] = (p, job, time.perf_counter())
        if not running:
            break  # past the deadline, or nothing startable
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:
            continue
        _, job, t0 = running.pop(pid)
        rec = dict(kind=job[0], width=job[1], lr=job[2], exit=os.waitstatus_to_exitcode(status),
                   wall_s=round(time.perf_counter() - t0, 1),
                   cpu_s=round(usage.ru_utime + usage.ru_stime, 1),
                   finished=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))  # fmt: skip
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    if pending:
        print(f"not started (deadline): {len(pending)} jobs: {pending}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--deadline", help="HH:MM UTC today: no job starts after it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan", type=Path, help="a JSON list of [model, width, rate] to run")
    ap.add_argument("--combine-only", action="store_true")
    a = ap.parse_args()
    deadline = None
    if a.deadline:
        hh, mm = (int(x) for x in a.deadline.split(":"))
        deadline = dt.datetime.now(dt.UTC).replace(hour=hh, minute=mm, second=0, microsecond=0)
    if not a.combine_only:
        sweep(a.out, a.workers, deadline, a.seed, a.plan)
    parts = sorted(f.parent for f in (a.out / "parts").glob("*/results.json"))
    r = recall.combine(parts, a.out / "combined")
    print(r.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
