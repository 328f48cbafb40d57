"""Before the GPU checks (tests/gpu/run.sh): does this Python import everything they need?

`--probe`: exit 0 when every third-party module imports, 1 otherwise, silently (run.sh then installs the wheels).
Otherwise one `setup.imports` result (the third-party modules and the project's entry points) and, on CUDA, one
`setup.cuda` result; the versions and the device go to `$OUT/environment.json`.
"""

from __future__ import annotations

import importlib
import json
import platform
import sys

from tests.gpu.common import Reporter, fmt, parse_args

THIRD_PARTY = ["torch", "triton", "transformers", "numpy", "tokenizers", "safetensors", "yaml", "jinja2", "tqdm",
               "gguf", "pydantic", "starlette", "uvicorn", "httptools", "httpx", "structlog", "prometheus_client",
               "ruamel.yaml", "pynvml"]
PROJECT = ["multiserve.cli", "gateway.server", "runtimes.server.worker", "runtimes.llm.engine",
           "runtimes.llm.attention.triton_paged", "partitioner.devices.nvml_backend", "tests.runtimes.llm.tiny"]
VERSIONS = ["torch", "triton", "transformers", "numpy", "tokenizers", "safetensors", "pydantic", "uvicorn", "uvloop",
            "nvidia-ml-py", "vllm"]  # vllm: optional (check_vllm.py skips without it)


def try_imports(modules: list[str]) -> dict[str, str]:
    """module -> error, for those that do not import."""
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main() -> int:
    if "--probe" in sys.argv:
        return 1 if try_imports(THIRD_PARTY) else 0
    args = parse_args(__doc__ or "", lambda p: p.add_argument("--probe", action="store_true"))
    rep = Reporter("setup", args.out)
    failed = try_imports(THIRD_PARTY + PROJECT)
    env: dict[str, object] = {"python": sys.version.split()[0], "executable": sys.executable,
                              "platform": platform.platform(), "packages": versions(), "import_errors": failed}
    packages = env["packages"]
    assert isinstance(packages, dict)
    rep.report("imports", not failed,
               fmt(python=env["python"], torch=packages["torch"], triton=packages["triton"],
                   transformers=packages["transformers"]) + (f" failed={sorted(failed)}" if failed else ""),
               import_errors=failed)
    if args.device == "cuda" and "torch" not in failed:
        import torch

        ok = torch.cuda.is_available()
        cuda: dict[str, object] = {"available": ok, "torch_cuda": torch.version.cuda}
        if ok:
            props = torch.cuda.get_device_properties(0)
            cuda.update(name=props.name, capability=f"{props.major}.{props.minor}",
                        memory_gib=round(props.total_memory / 2**30, 1), count=torch.cuda.device_count())
        env["cuda"] = cuda
        rep.report("cuda", ok, fmt(**{k: v for k, v in cuda.items() if k != "available"}), **cuda)
    (args.out / "environment.json").write_text(json.dumps(env, indent=1, default=str) + "\n")
    return rep.exit_code()


if __name__ == "__main__":
    sys.exit(main())
