"""The serving processes on the GPU: `multiserve worker --device cuda`, and `multiserve serve` with a registry whose
model has `device: cuda`, each answering chat requests over HTTP.

The model is a tiny random-weight Llama written as GGUF with the tests' helper (tests/runtimes/llm/tiny.py); no
real weights are needed. Each process runs on a free loopback port until /ready, then:

* `worker`: a chat completion (greedy, 8 tokens, `ignore_eos`) and a streamed one; then SIGTERM, exit code 0.
* `serve`: the gateway plans the registry onto the GPU (a timeslice placement with `memory_gib`, so the worker
  caps its CUDA memory at the planned fraction) and starts the worker; a chat completion through the gateway;
  then SIGTERM, exit code 0.

* `memory_model` (CUDA only): a model with no memory size is planned from its GGUF header, served, asked once;
  the worker must hold no more GPU memory than the plan reserved (weights + KV + the overhead allowance).

On CUDA each also checks that its own process used the device: its pid among nvidia-smi's compute processes, or a
GPU's device file (/dev/nvidiaN, which a CUDA context keeps open) open in it; the device-wide rise in memory in use
is reported, not taken as evidence. Logs of failed runs are kept in `$OUT/serve/`.
`--device cpu` runs the same with `device: cpu`, to try the script without a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from model_pool.launcher import free_port
from tests.gpu import serving
from tests.gpu.common import Reporter, fmt, parse_args, timed
from tests.gpu.serving import children, gpu_memory_used_mib, http, process, tail

DEVICE = "cuda"  # and LOGS: set by main() from the arguments
LOGS = Path("gpu-results") / "serve"
READY_S = 60.0
MIB = 1 << 20
MAX_TOKENS = 8


def serve_argv(registry: Path) -> list[str]:
    """`multiserve serve` on `registry`, read-only on the devices: `--apply-partition no`, so the gateway never
    creates MIG devices or starts MPS daemons (its default, auto, would as root on a MIG host); the registries here
    need neither (a timeslice placement)."""
    return [sys.executable, "-m", "multiserve", "serve", "--config", str(registry), "--apply-partition", "no"]


def write_model(path: Path) -> Path:
    """A tiny random Llama (head_dim 64, GQA) as an F32 GGUF file."""
    from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

    model = hf_model(TinySpec(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                              max_position_embeddings=1024), seed=1)
    return write_gguf(model, path)


def on_device(pids: list[int], before_mib: int | None) -> dict[str, object]:
    return serving.on_device(pids, before_mib) if DEVICE == "cuda" else {"ok": True}


def wait_ready(base: str, proc: subprocess.Popen, log: Path) -> float:
    return serving.wait_ready(base, proc, log, READY_S)


def chat(base: str, model: str, stream: bool = False) -> dict[str, object]:
    """One greedy chat completion; what came back, checked."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with timed() as t:
        status, raw = http("POST", f"{base}/v1/chat/completions", body)
    result: dict[str, object] = {"status": status, "seconds": round(t["s"], 3)}
    if status != 200:
        return {**result, "ok": False, "body": raw.decode(errors="replace")[:1000]}
    if not stream:
        reply = json.loads(raw)
        choice = reply["choices"][0]
        tokens = reply["usage"]["completion_tokens"]
        return {**result, "ok": tokens == MAX_TOKENS and choice["finish_reason"] == "length"
                and isinstance(choice["message"]["content"], str), "completion_tokens": tokens,
                "finish_reason": choice["finish_reason"], "content": choice["message"]["content"]}
    events = [line[len(b"data: "):] for line in raw.splitlines() if line.startswith(b"data: ")]
    chunks = [json.loads(e) for e in events if e != b"[DONE]"]
    content = [c for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content") is not None]
    usage = chunks[-1].get("usage") if chunks else None
    return {**result, "ok": bool(events) and events[-1] == b"[DONE]" and usage is not None
            and usage["completion_tokens"] == MAX_TOKENS, "chunks": len(chunks), "content_chunks": len(content),
            "usage": usage}


def check_worker(rep: Reporter, model_path: Path) -> None:
    port = free_port()
    log = LOGS / "worker.log"
    before = gpu_memory_used_mib()
    argv = [sys.executable, "-m", "multiserve", "worker", "--source", str(model_path), "--name", "tiny",
            "--device", DEVICE, "--engine-json", '{"block_size": 16, "kv_cache_gib": 0.05, "max_num_seqs": 8}',
            "--host", "127.0.0.1", "--port", str(port)]
    with process(argv, log) as proc:
        base = f"http://127.0.0.1:{port}"
        ready_s = wait_ready(base, proc, log)
        plain, streamed = chat(base, "tiny"), chat(base, "tiny", stream=True)
        device = on_device([proc.pid], before)
    ok = bool(plain["ok"] and streamed["ok"] and device["ok"]) and proc.returncode == 0
    rep.report("worker", ok, fmt(ready_s=ready_s, chat=plain["status"], stream=streamed["status"],
                                 on_device=device["ok"], exit_code=proc.returncode),
               device=DEVICE, ready_s=ready_s, chat=plain, stream=streamed, on_device=device,
               exit_code=proc.returncode, log_tail=None if ok else tail(log, 4000))


REGISTRY = """\
gateway: {{host: 127.0.0.1, port: {port}}}
models:
  - name: tiny-chat
    aliases: [tiny]
    type: chat
    source: {{path: {model}}}
    replicas: 1
    device: {device}
{placement}    engine: {{block_size: 16, {kv}max_model_len: 512, max_num_seqs: 8}}
"""


def check_serve(rep: Reporter, model_path: Path) -> None:
    port = free_port()
    registry = LOGS / "registry.yaml"
    placement = "    placement: {isolation: timeslice, memory_gib: 4}\n" if DEVICE == "cuda" else ""
    registry.write_text(REGISTRY.format(port=port, model=model_path, device=DEVICE, placement=placement,
                                        kv="kv_cache_gib: 0.05, "))
    log = LOGS / "gateway.log"
    env = {"MULTISERVE_ADMIN_TOKEN": "gpu-check-admin-token", "MULTISERVE_LOG_DIR": str(LOGS / "workers")}
    before = gpu_memory_used_mib()
    argv = serve_argv(registry)
    with process(argv, log, env) as proc:
        base = f"http://127.0.0.1:{port}"
        ready_s = wait_ready(base, proc, log)
        plain = chat(base, "tiny-chat")
        workers = children(proc.pid)
        device = on_device(workers, before)
    ok = bool(plain["ok"] and device["ok"] and workers) and proc.returncode == 0
    worker_logs = {p.name: tail(p, 3000) for p in sorted((LOGS / "workers").glob("*.log"))} if not ok else None
    rep.report("serve", ok, fmt(ready_s=ready_s, chat=plain["status"], workers=len(workers),
                                on_device=device["ok"], exit_code=proc.returncode),
               device=DEVICE, ready_s=ready_s, chat=plain, workers=workers, on_device=device,
               exit_code=proc.returncode, gateway_log_tail=None if ok else tail(log, 4000), worker_logs=worker_logs)


def gpu_memory_of(pids: list[int]) -> int | None:
    """MiB the processes `pids` hold on the GPU, as nvidia-smi lists them (None when it lists none of them: another
    pid namespace)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.count(",") == 1]
    used = [int(mib) for pid, mib in rows if pid.isdigit() and mib.isdigit() and int(pid) in pids]
    return sum(used) if used else None


def check_memory_model(rep: Reporter, model_path: Path) -> None:
    """The planner's memory model on the device: a model with neither `memory_gib` nor `kv_cache_gib` is planned from
    its GGUF header (weights at 2 bytes a parameter + one full-length sequence of KV + the overhead allowance); the
    worker serving it, after a chat request, must hold no more GPU memory than the plan reserved. The overhead it
    measures (held - weights - KV: CUDA context, allocator slack, activations) is reported against the allowance."""
    from partitioner.planning.demand import DEFAULT_OVERHEAD_BYTES

    port = free_port()
    registry = LOGS / "registry-memory.yaml"
    registry.write_text(REGISTRY.format(port=port, model=model_path, device=DEVICE, kv="",
                                        placement="    placement: {isolation: timeslice}\n"))
    planned = subprocess.run([sys.executable, "-m", "multiserve", "partition", "plan", "--config", str(registry),
                              "--json"], capture_output=True, text=True, timeout=120, check=False)
    if planned.returncode != 0:
        rep.report("memory_model", False, "partition plan failed", stderr=planned.stderr[-2000:])
        return
    replica = next(r for r in json.loads(planned.stdout)["replicas"] if r["replica_id"] == "tiny-chat/0")
    reserved_mib = replica["memory_bytes"] / MIB
    weights_and_kv_mib = (replica["memory_bytes"] - DEFAULT_OVERHEAD_BYTES) / MIB
    log = LOGS / "gateway-memory.log"
    env = {"MULTISERVE_ADMIN_TOKEN": "gpu-check-admin-token", "MULTISERVE_LOG_DIR": str(LOGS / "workers-memory")}
    before = gpu_memory_used_mib()
    with process(serve_argv(registry), log, env) as proc:
        wait_ready(f"http://127.0.0.1:{port}", proc, log)
        answered = chat(f"http://127.0.0.1:{port}", "tiny-chat")
        workers = children(proc.pid)
        held = gpu_memory_of(workers)
        after = gpu_memory_used_mib()
    how = "nvidia-smi per process"
    if held is None and after is not None and before is not None:
        held, how = after - before, "device memory in use, before and after"
    ok = bool(answered["ok"]) and held is not None and held <= reserved_mib
    rep.report("memory_model", ok, fmt(held_mib=held, reserved_mib=round(reserved_mib),
                                       overhead_mib=None if held is None else round(held - weights_and_kv_mib),
                                       allowance_mib=DEFAULT_OVERHEAD_BYTES // MIB),
               held_mib=held, measured_by=how, reserved_mib=reserved_mib, weights_and_kv_mib=weights_and_kv_mib,
               plan=replica, chat=answered, log_tail=None if ok else tail(log, 4000))


def main() -> int:
    global DEVICE, LOGS
    args = parse_args(__doc__ or "")
    DEVICE, LOGS = args.device, args.out / "serve"
    rep = Reporter("serve", args.out)
    LOGS.mkdir(parents=True, exist_ok=True)
    model_path = write_model(LOGS / "tiny.gguf")
    rep.guarded("worker", lambda: check_worker(rep, model_path))
    rep.guarded("serve", lambda: check_serve(rep, model_path))
    if DEVICE == "cuda":  # the CPU has no device memory to plan
        rep.guarded("memory_model", lambda: check_memory_model(rep, model_path))
    return rep.exit_code()


if __name__ == "__main__":
    sys.exit(main())
