"""Gather the GPU checks' results into `$OUT/summary.json` (the last step of tests/gpu/run.sh; stdlib only).

Reads `$OUT/groups.jsonl` (one line per step run.sh ran: group, exit code, seconds, timeout) and each group's
`$OUT/<group>.jsonl` (one result per line, see tests/gpu/common.py). A group that exited non-zero without
reporting a failure (it crashed, or its timeout stopped it) counts as a failure `<group>.exit`, with the tail of
its stderr. A result with a `skipped` reason (a check that cannot run here: no vLLM, no MIG) is neither passed nor
failed. Prints one verdict line per group (also for one that timed out or was not run), a closing line, then
`skipped <name>: <reason>` for each skipped result; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_STEP_COLUMNS = ("model", "dtype", "batch", "layers", "context", "step_ms", "floor_ms", "floor_with_kv_ms",
                 "ratio_to_floor", "tokens_per_s", "eager_step_ms", "no_overlap_step_ms", "graph_speedup",
                 "graph_replays", "weight_bytes", "copy_gbs")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short when a timeout stopped the writer
            continue
    return rows


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def verdict(name: str, group: dict) -> str:
    """One line for a group: `<group> PASS|FAIL|NOT RUN`, its counts, how it ended and its time."""
    rc = group.get("rc", 0)
    counts = f"{group['passed']} passed, {len(group['failed'])} failed, {len(group['skipped'])} skipped"
    if rc == 125:
        return f"{name:<12} NOT RUN  no time left in the budget"
    word = "FAIL" if group["failed"] else "PASS"
    how = f"timed out after {group.get('timeout_s')} s; " if rc in (124, 137) else ""
    cap = f" of {group['timeout_s']}" if group.get("timeout_s") is not None else ""
    return f"{name:<12} {word:<8} {how}{counts} ({group.get('duration_s', 0)} s{cap})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--duration-s", type=float, default=None)
    parser.add_argument("--budget-s", type=float, default=None)
    args = parser.parse_args()
    out: Path = args.out
    results: list[dict] = []
    groups: dict[str, dict] = {}
    for step in read_jsonl(out / "groups.jsonl"):
        name = step["group"]
        rows = read_jsonl(out / f"{name}.jsonl")
        if step.get("rc", 0) != 0 and not any(not r.get("ok") for r in rows):
            why = "timed out" if step.get("rc") in (124, 137) else "not run" if step.get("rc") == 125 else "exited"
            rows.append({"name": f"{name}.exit", "ok": False, "summary": f"{why} (exit code {step.get('rc')})",
                         "stderr_tail": tail(out / f"{name}.stderr") or tail(out / f"{name}.log")})
        groups[name] = {**step, "passed": sum(1 for r in rows if r.get("ok") and not r.get("skipped")),
                        "failed": [r["name"] for r in rows if not r.get("ok")],
                        "skipped": [r["name"] for r in rows if r.get("skipped")]}
        results += rows
    failed = [r["name"] for r in results if not r.get("ok")]
    skipped = {r["name"]: r["skipped"] for r in results if r.get("skipped")}
    environment = json.loads((out / "environment.json").read_text()) if (out / "environment.json").exists() else {}
    device_csv = (out / "device.csv").read_text().strip().splitlines() if (out / "device.csv").exists() else []
    summary = {
        "ok": bool(results) and not failed,
        "device": args.device,
        "passed": len(results) - len(failed) - len(skipped),
        "failed": failed,
        "skipped": skipped,
        "duration_s": args.duration_s,
        "budget_s": args.budget_s,
        "nvidia_smi": device_csv,
        "environment": environment,
        "groups": groups,
        "decode_step_table": [{k: r[k] for k in _STEP_COLUMNS if k in r}
                              for r in results if r.get("table") == "decode_step"],
        "results": results,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    duration = f" in {args.duration_s:.0f} s" if args.duration_s is not None else ""
    why = "".join(f"\nskipped {name}: {reason}" for name, reason in skipped.items())
    for name, group in groups.items():
        print(verdict(name, group))
    print(f"{summary['passed']} passed, {len(failed)} failed, {len(skipped)} skipped{duration}; summary: "
          f"{out / 'summary.json'}{why}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
