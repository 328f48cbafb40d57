"""A vLLM server as a replica of `multiserve serve` (`launcher: command`, `preset: vllm`) on the GPU, when the
checks' Python imports vllm; otherwise the serving part is skipped, saying why.

The model and the registry are tests/gpu/vllm_replica.py's: a tiny random Llama as a Hugging Face directory, one
`preset: vllm` model with `device: cuda` and an `exclusive` placement with `memory_gib: 8`.

* `model`: the directory loads the way vLLM loads it (transformers' AutoConfig and a fast AutoTokenizer), its chat
  template renders, and greedy decoding in transformers gives 8 letters.
* `command`: the registry validates, is planned onto this host's GPUs (the shipped H200 inventory with
  `--device cpu`), and the command line the pool would start is `vllm serve <model dir>` with the preset's and the
  registry's flags, `--gpu-memory-utilization` being memory_gib over the planned device's memory.
* `serve` (CUDA and vLLM only): `multiserve serve` gets ready within the time left (vLLM's start-up); /health/models
  shows the replica ready, and its process runs that command line on the port the pool dials; it uses the GPU.
* `chat`, `stream`: a chat completion and a streamed one through the gateway: 200, text, `model` the registry's
  name (vLLM answers as the served name; the gateway writes the registry's back), usage with 8 completion tokens.
* `shutdown`: SIGTERM to the gateway, exit code 0, and no process left of the replica's process group or under it.

Its time: $GPU_CHECK_TIMEOUT_S (what run.sh gives it), else $GPU_CHECK_VLLM_TIMEOUT_S (default 180); the wait for
/ready is what remains after the rest and a reserve for the requests and the shutdown. $GPU_CHECK_VLLM_ARGS adds
arguments to vLLM's command line. Logs (the gateway's, vLLM's) are kept in `$OUT/vllm/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from foundation.config_files import config_path
from model_pool.launcher import free_port
from partitioner.devices.inventory import Inventory
from partitioner.devices.read import load_host_inventory
from tests.gpu.common import Reporter, fmt, parse_args, timed
from tests.gpu.serving import (
    cmdline,
    descendants,
    gpu_memory_used_mib,
    group_members,
    http,
    on_device,
    process,
    tail,
)
from tests.gpu.vllm_replica import (
    MEMORY_GIB,
    MODEL_NAME,
    STOP_GRACE_S,
    command_problems,
    letter_ids,
    planned_command,
    probe_result,
    registry_text,
    start_probe,
    write_launcher,
    write_model,
)

ARGS = parse_args(__doc__ or "")
DEVICE = ARGS.device
LOGS = ARGS.out / "vllm"
TIME_LIMIT_S = float(os.environ.get("GPU_CHECK_TIMEOUT_S") or os.environ.get("GPU_CHECK_VLLM_TIMEOUT_S") or 180)
RESERVE_S = 40.0  # after /ready: two requests, the gateway's stop (its SIGTERM, vLLM's), the look for leftovers
EXTRA_ARGS = tuple(shlex.split(os.environ.get("GPU_CHECK_VLLM_ARGS", "")))
MAX_TOKENS = 8
GIB = 1 << 30
REPLICA_LOG = LOGS / "replicas" / f"{MODEL_NAME}-0.log"  # the pool's log of the command replica's output
H200 = config_path("inventories", "h200-141gb.json")
UUID_HINT = ("this vLLM reads CUDA_VISIBLE_DEVICES as integers, and the plan gives a GPU's UUID: a vLLM that "
             "resolves UUIDs is needed")


def check_model(rep: Reporter, model_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with timed() as t:
        write_model(model_dir)
    config, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, len(ids):].tolist()
    text = tokenizer.decode(new)
    ok = bool(tokenizer.is_fast and len(tokenizer) == config.vocab_size and set(new) <= set(letter_ids())
              and len(text) == MAX_TOKENS)
    rep.report("model", ok, fmt(write_s=t["s"], tokenizer=type(tokenizer).__name__, prompt_tokens=len(ids),
                                text=repr(text)),
               files=sorted(p.name for p in model_dir.iterdir()), tokenizer=type(tokenizer).__name__,
               vocab_size=config.vocab_size, prompt=prompt, text=text, token_ids=new)


def device_inventory() -> Inventory:
    """This host's GPUs as `multiserve serve` reads them; with --device cpu, the shipped H200's."""
    return load_host_inventory(None if DEVICE == "cuda" else str(H200), os.environ)


def check_command(rep: Reporter, registry: Path, binary: Path, model_dir: Path, port: int,
                  scratch: Path) -> float | None:
    """The planned command line; returns the plan's memory fraction (None when the check failed)."""
    inventory = device_inventory()
    argv, placement = planned_command(registry, inventory, port, scratch / "arbiter")
    visible = placement.env.get("CUDA_VISIBLE_DEVICES")
    device = next((d for d in inventory.devices if d.uuid == visible), None)
    if device is None or placement.memory_fraction is None:
        rep.report("command", False, f"not planned onto a GPU: CUDA_VISIBLE_DEVICES={visible!r}",
                   placement=placement, inventory=inventory.source)
        return None
    fraction = placement.memory_fraction
    expected = MEMORY_GIB * GIB / device.memory_total_bytes
    problems = command_problems(argv, model_dir, fraction, port)
    if argv[0] != str(binary):
        problems.append(f"runs {argv[0]!r}, expected {str(binary)!r}")
    if abs(fraction - expected) > 1e-9:
        problems.append(f"memory fraction {fraction}, expected {MEMORY_GIB} GiB / {device.memory_total_bytes} B")
    rep.report("command", not problems, fmt(device=device.name.replace(" ", "_"), gpu_memory_utilization=fraction)
               + (f" problems={problems}" if problems else ""),
               argv=argv, env=placement.env, memory_fraction=fraction, device=device.name,
               inventory=inventory.source, problems=problems)
    return fraction


def chat(base: str, stream: bool) -> dict[str, object]:
    """One greedy chat completion through the gateway, and what is wrong with it."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with timed() as t:
        status, raw = http("POST", f"{base}/v1/chat/completions", body, timeout=60)
    result: dict[str, object] = {"status": status, "seconds": round(t["s"], 3)}
    if status != 200:
        return {**result, "ok": False, "problems": [f"status {status}"], "body": raw.decode(errors="replace")[:1000]}
    read = _streamed(raw) if stream else _whole(raw)
    models, text, usage, problems = read.pop("models"), read["text"], read["usage"], read.pop("problems")
    if models != [MODEL_NAME]:
        problems.append(f"model {models}, expected {MODEL_NAME!r}")
    if not (isinstance(text, str) and text):
        problems.append(f"no text: {text!r}")
    if not usage or usage.get("completion_tokens") != MAX_TOKENS or not usage.get("prompt_tokens"):
        problems.append(f"usage {usage}, expected {MAX_TOKENS} completion tokens and the prompt's")
    return {**result, **read, "ok": not problems, "problems": problems, "models": models}


def _whole(raw: bytes) -> dict:
    reply = json.loads(raw)
    choice = reply["choices"][0]
    return {"models": [str(reply.get("model"))], "text": choice["message"]["content"], "usage": reply.get("usage"),
            "finish_reason": choice.get("finish_reason"), "problems": []}


def _streamed(raw: bytes) -> dict:
    """The SSE events' models, text and usage (the last chunk's, with include_usage)."""
    events = [line[len(b"data: "):] for line in raw.splitlines() if line.startswith(b"data: ")]
    chunks = [json.loads(e) for e in events if e != b"[DONE]"]
    ended = bool(events) and events[-1] == b"[DONE]"
    return {"models": sorted({str(c.get("model")) for c in chunks}),
            "text": "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")),
            "usage": chunks[-1].get("usage") if chunks else None, "chunks": len(chunks),
            "problems": [] if ended else ["the stream does not end with [DONE]"]}


def replica_of(base: str) -> dict | None:
    """The model's one replica as GET /health/models shows it, and its group's ready count."""
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        status, raw = http("GET", f"{base}/health/models", timeout=5)
        if status == 200:
            group = json.loads(raw)["models"][MODEL_NAME]
            return {**group["replicas"][0], "ready_replicas": group["ready_replicas"]}
    return None


def wait_ready(base: str, gateway: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until the gateway's /ready; raises at once when the gateway exits or its replica crashed (the pool
    would restart it: a crash loop is not worth the wait), else after `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if gateway.poll() is not None:
            raise RuntimeError(f"the gateway exited with {gateway.returncode} before /ready")
        with contextlib.suppress(OSError):
            if http("GET", f"{base}/ready", timeout=2)[0] == 200:
                return time.monotonic() - started
        replica = replica_of(base)
        if replica is not None and (replica["restarts"] or replica["state"] in ("unhealthy", "failed")):
            raise RuntimeError(f"the vLLM replica died while starting: state {replica['state']}, "
                               f"restarts {replica['restarts']}")
        time.sleep(1.0)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def check_serve(rep: Reporter, registry: Path, port: int, model_dir: Path, fraction: float, ready_budget_s: float,
                probe: dict[str, str | None]) -> None:
    """`serve`, `chat`, `stream` and `shutdown`, in that order (see the module's docstring)."""
    if ready_budget_s < 30:
        rep.report("serve", False, f"not run: {ready_budget_s:.0f} s left for vLLM's start-up in this check's "
                                   f"{TIME_LIMIT_S:.0f} s (GPU_CHECK_VLLM_TIMEOUT_S)", vllm=probe)
        return
    base, log = f"http://127.0.0.1:{port}", LOGS / "gateway.log"
    env = {"MULTISERVE_ADMIN_TOKEN": "gpu-check-admin-token", "MULTISERVE_LOG_DIR": str(LOGS / "replicas"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    before = gpu_memory_used_mib()
    argv = [sys.executable, "-m", "multiserve", "serve", "--config", str(registry)]
    with process(argv, log, env, stop_timeout_s=STOP_GRACE_S + 15) as gateway:
        try:
            ready_s = wait_ready(base, gateway, ready_budget_s)
        except RuntimeError as exc:
            replica = replica_of(base)
            vllm_log = tail(REPLICA_LOG, 4000)
            hint = f" ({UUID_HINT})" if "invalid literal for int() with base 10: 'GPU-" in vllm_log else ""
            rep.report("serve", False, f"{exc}{hint}", replica=replica, vllm=probe, vllm_log_tail=vllm_log,
                       gateway_log_tail=tail(log, 4000))
        else:
            replica = report_ready(rep, base, ready_s, model_dir, fraction, before, probe)
            for name, stream in (("chat", False), ("stream", True)):
                answered = chat(base, stream)
                ok = bool(answered.pop("ok"))
                rep.report(name, ok, fmt(status=answered["status"], text=repr(answered.get("text")))
                           + (f" problems={answered['problems']}" if answered["problems"] else ""), **answered)
        pgid = replica["pid"] if replica else None
        group = replica_processes(pgid)
    report_shutdown(rep, gateway.returncode, pgid, group)


def report_ready(rep: Reporter, base: str, ready_s: float, model_dir: Path, fraction: float, before_mib: int | None,
                 probe: dict[str, str | None]) -> dict:
    """The replica as /health/models shows it: ready, and its process running the vLLM command line on the port
    the pool dials, on the GPU. Returns it."""
    replica = replica_of(base) or {}
    pid = replica.get("pid")
    running = cmdline(pid) if pid else []
    problems = command_problems(running, model_dir, fraction, urlsplit(str(replica.get("url"))).port or -1)
    if replica.get("state") != "ready" or replica.get("ready_replicas") != 1:
        problems.append(f"replica state {replica.get('state')}, {replica.get('ready_replicas')} ready")
    group = replica_processes(pid)
    device = on_device(group, before_mib)
    if not device["ok"]:
        problems.append("no sign that it uses the GPU")
    rep.report("serve", not problems, fmt(ready_s=ready_s, vllm=probe.get("version"), state=replica.get("state"),
                                          processes=len(group), on_device=device["ok"])
               + (f" problems={problems}" if problems else ""),
               ready_s=ready_s, vllm=probe, replica=replica, cmdline=running, processes=group, on_device=device,
               problems=problems, vllm_log_tail=tail(REPLICA_LOG, 4000) if problems else None)
    return replica


def replica_processes(pgid: int | None) -> list[int]:
    """The replica's processes: its process group (the pool makes it the leader of a new one) and what is under
    its leader (vLLM's engine core)."""
    return [] if pgid is None else sorted({pgid, *group_members(pgid), *descendants(pgid)})


def report_shutdown(rep: Reporter, exit_code: int | None, pgid: int | None, group: list[int]) -> None:
    """After the gateway stopped: no process of the replica's left (SIGKILLed ones get a few seconds to go). Any
    left is killed here, by its pid, so that it does not keep the GPU."""
    deadline = time.monotonic() + 10
    left = group
    while time.monotonic() < deadline:
        left = sorted({*(group_members(pgid) if pgid is not None else []), *filter(_alive, group)})
        if not left:
            break
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    ok = exit_code == 0 and pgid is not None and not left
    rep.report("shutdown", ok, fmt(exit_code=exit_code, replica_pgid=pgid, left=left),
               exit_code=exit_code, replica_pgid=pgid, processes=group, left=left)


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def skip_reason(probe: dict[str, str | None]) -> str | None:
    if "error" in probe:
        return f"vLLM is not importable in {sys.executable}: {probe['error']}"
    if DEVICE != "cuda":
        return f"vLLM {probe.get('version')} is importable, but --device cpu: a vLLM replica needs CUDA"
    return None


def main() -> int:
    started = time.monotonic()
    rep = Reporter("vllm", ARGS.out)
    LOGS.mkdir(parents=True, exist_ok=True)
    probing = start_probe()  # imports vLLM while the model is written
    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as tmp:
        scratch = Path(tmp)
        model_dir = scratch / "models" / MODEL_NAME
        rep.guarded("model", lambda: check_model(rep, model_dir))
        probe = probe_result(probing)
        (scratch / "bin").mkdir()
        binary = write_launcher(scratch / "bin" / "vllm", entry=probe.get("entry"))
        registry = LOGS / "registry.yaml"
        port = free_port()
        registry.write_text(registry_text(port, model_dir, binary, EXTRA_ARGS))
        fractions: list[float | None] = []
        rep.guarded("command", lambda: fractions.append(check_command(rep, registry, binary, model_dir, port,
                                                                      scratch)))
        reason = skip_reason(probe)
        if reason is not None:
            rep.skip("serve", reason, vllm=probe)
        elif not fractions or fractions[0] is None:
            rep.report("serve", False, "not run: the command check failed", vllm=probe)
        else:
            budget = TIME_LIMIT_S - RESERVE_S - (time.monotonic() - started)
            rep.guarded("serve", lambda: check_serve(rep, registry, port, model_dir, fractions[0], budget, probe))
    return rep.exit_code()


if __name__ == "__main__":
    sys.exit(main())
