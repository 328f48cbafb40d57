"""The `multiserve` command line: `serve` (the gateway), `worker` (one replica), `generate` (a smoke test),
`partition`, `bench`, `profile` and `plan-capacity`. It only parses and dispatches: each command's work lives in
its package (the worker's process assembly in multiserve/worker.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from foundation import config_files

DEFAULT_CONFIG = config_files.config_path("default.yaml")


def resolve_model_source(model: str, config_path: Path = DEFAULT_CONFIG) -> str:
    """A model name or alias from the registry YAML, else a path or `package:file` as given."""
    from registry.store import load_registry

    spec = load_registry(config_path).resolve(model) if config_path.exists() else None
    return model if spec is None else spec.source_ref()


def _generate(args: argparse.Namespace) -> int:
    from foundation.request_errors import InvalidRequestError
    from runtimes.llm.config import EngineConfig
    from runtimes.llm.engine import LLMEngine
    from runtimes.llm.sampling_params import SamplingParams

    engine = LLMEngine.from_source(
        resolve_model_source(args.model, Path(args.config)),
        EngineConfig(device=args.device, kv_cache_bytes=256 << 20),
    )
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    try:
        engine.add_request("cli", prompt, params)
    except InvalidRequestError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finish = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            finish = out.finish_reason or finish
    sys.stdout.write("\n")
    print(f"[finish_reason={finish}]", file=sys.stderr)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from multiserve.worker import run_worker_command

    return run_worker_command(args)


def _add_worker_parser(sub: argparse._SubParsersAction) -> None:
    worker = sub.add_parser("worker", help="serve one model replica over an OpenAI-compatible HTTP API")
    worker.add_argument("--launch", default=None,
                        help="the replica's launch as JSON (what the gateway's pool passes); else the options below")
    worker.add_argument("--source", default=None, help="a GGUF/HF path or package:file")
    worker.add_argument("--name", default=None, help="the model name clients send")
    worker.add_argument("--type", default="chat", choices=("chat", "completion", "embedding"),
                        help="the registry's model type: chat and completion models get the LLM engine, "
                             "embedding models the encoder engine and /v1/embeddings (default: chat)")
    worker.add_argument("--alias", action="append", default=[], help="another accepted name (repeatable)")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=8000)
    worker.add_argument("--device", default=None, help="auto | cpu | cuda (default: auto)")
    worker.add_argument("--engine-json", default=None,
                        help='the registry\'s engine: options for the model\'s type and the engine\'s side of its '
                             'policy: as JSON, e.g. \'{"block_size": 16, "kv_cache_gib": 1, "max_queue_len": 64}\'')
    worker.add_argument("--log-level", default="warning", help="uvicorn's log level")
    worker.add_argument("--standby", action="store_true",
                        help="import the runtimes, then serve the assignment read as one JSON line from standard "
                             "input (the gateway's warm pool of workers)")
    worker.add_argument("--stall-timeout-s", type=float, default=60.0,
                        help="the replica reports itself unready when its engine loop makes no progress this long")
    worker.set_defaults(func=_worker)


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import run_serve
    from multiserve.partition_apply import prepare_devices

    status = prepare_devices(args.config, args.apply_partition)
    return status if status else run_serve(args.config, args.host, args.port, args.ray_address)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the gateway and the replicas of every model in the registry")
    serve.add_argument("--config", default=str(DEFAULT_CONFIG), help="the registry YAML (watched for edits)")
    serve.add_argument("--host", default=None, help="default: gateway.host from the registry (127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="default: gateway.port from the registry")
    serve.add_argument("--apply-partition", choices=("auto", "yes", "no"), default="auto",
                       help="create the MIG devices and start the MPS daemons the plan needs before any replica "
                            "starts: yes; no (serve then refuses such a plan, naming `partition apply`); auto "
                            "(default): yes when this process may (MPS daemons always, MIG devices as root)")
    serve.add_argument("--ray-address", default=None,
                       help="the Ray cluster for `launcher: ray` models: auto, host:port or ray://host:port "
                            "(default: gateway.ray.address, else auto)")
    serve.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multiserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt with a model (a smoke test for humans)")
    gen.add_argument("--model", required=True, help="registry name or alias, a GGUF/HF path, or package:file")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda")
    gen.add_argument("--config", default=str(DEFAULT_CONFIG), help="registry YAML used to resolve names")
    gen.set_defaults(func=_generate)
    _add_worker_parser(sub)
    _add_serve_parser(sub)
    from multiserve.partition_apply import add_apply_parser
    from multiserve.partition_cli import add_partition_parser

    add_apply_parser(add_partition_parser(sub, DEFAULT_CONFIG), DEFAULT_CONFIG)
    from bench.cli import add_bench_parsers

    add_bench_parsers(sub)  # bench (run, compare, plot), profile, plan-capacity
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
