"""`multiserve worker`: one replica's process, assembled from its parts. Its launch (registry/launch.py) comes from
the pool as one JSON document (`--launch`), or is built from the command line's options for a replica started by
hand; the engine and its HTTP face come from runtimes/, the time-slice lease from the partitioner's arbiter client,
and the launch token from the gateway's launcher (its environment).

`multiserve worker --standby` is a worker started before there is a replica for it (the local launcher's warm pool,
`gateway.warm_workers`): it imports the runtimes (torch, the engines, the HTTP stack: most of a worker's start) and
then waits for one line on its standard input, its assignment (`registry.launch.StandbyAssignment`: the launch,
where to listen, the token and the replica's log file), and serves it as `--launch` would. CUDA reads its variables
when it is first used, which the imports do not do, so the placement's environment still applies."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from pydantic import ValidationError

from foundation.http.wire import REPLICA_TOKEN_ENV
from registry.engine import QueueOptions
from registry.errors import FieldProblems, pydantic_problems
from registry.launch import ReplicaLaunch, StandbyAssignment
from runtimes.server.worker import run_worker

_QUEUE_OPTIONS = frozenset(QueueOptions.model_fields)


def launch_from_args(args: argparse.Namespace) -> ReplicaLaunch:
    """The launch `--launch` gives, or one built from `--source`, `--name`, `--type`, `--alias`, `--device` and
    `--engine-json` (the registry's `engine:` options of the model's type and the engine's side of `policy:`).
    Raises ValueError saying which option is wrong and how."""
    if args.launch is not None:
        return _validated("--launch", lambda: ReplicaLaunch.model_validate_json(args.launch))
    if not args.source or not args.name:
        raise ValueError("give --launch, or --source and --name")
    options = json.loads(args.engine_json) if args.engine_json else {}
    if not isinstance(options, dict):
        raise ValueError(f"--engine-json: must be a JSON object, got {type(options).__name__}")
    queue = {k: v for k, v in options.items() if k in _QUEUE_OPTIONS}
    engine = {k: v for k, v in options.items() if k not in _QUEUE_OPTIONS}
    document = {"model": args.name, "index": 0, "type": args.type, "source": args.source,
                "aliases": list(args.alias), "device": args.device or "auto", "engine": engine, "queue": queue}
    return _validated("--engine-json", lambda: ReplicaLaunch.model_validate(document))


def _validated(option: str, build: Callable[[], ReplicaLaunch]) -> ReplicaLaunch:
    try:
        return build()
    except ValidationError as exc:
        problems = pydantic_problems(exc)
    except FieldProblems as exc:
        problems = list(exc.problems)
    raise ValueError(f"{option}: " + "; ".join(str(p) for p in problems))


def run_worker_command(args: argparse.Namespace) -> int:
    """Serve one replica until SIGTERM; 2 on a bad launch or bad options (the message says which)."""
    if args.standby:
        return run_standby(args)
    try:
        launch = launch_from_args(args)
    except ValueError as err:  # json.JSONDecodeError included
        print(f"error: {err}", file=sys.stderr)
        return 2
    token = os.environ.pop(REPLICA_TOKEN_ENV, None) or None  # not passed on to anything this process starts
    return _serve(launch, args.host, args.port, token, args)


def run_standby(args: argparse.Namespace) -> int:
    """Import what serving takes, then wait for the assignment line and serve it; 2 on a bad one, 0 when standard
    input closes first (the launcher let the standby go)."""
    import structlog

    from foundation.logs import configure_logging
    from runtimes.server.worker import preload

    configure_logging()
    started = time.perf_counter()
    preload()
    structlog.get_logger(__name__).info("standby_ready", import_s=round(time.perf_counter() - started, 3))
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    try:
        assignment = StandbyAssignment.model_validate_json(line)
    except ValidationError as exc:
        print(f"error: the assignment: {'; '.join(str(p) for p in pydantic_problems(exc))}", file=sys.stderr)
        return 2
    if assignment.log_path is not None:  # from here on the replica's own log, as a worker launched for it
        fd = os.open(assignment.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.update(assignment.launch.placement.env)
    return _serve(assignment.launch, assignment.host, assignment.port, assignment.token, args)


def _serve(launch: ReplicaLaunch, host: str, port: int, token: str | None, args: argparse.Namespace) -> int:
    placement = launch.placement
    gate = None
    if placement.arbiter_socket:  # the device is time-shared: every engine step takes the arbiter's lease
        from partitioner.timeslice.client import LeaseClient

        gate = LeaseClient(placement.arbiter_socket, placement.arbiter_client or launch.replica_id,
                           placement.arbiter_weight)
    try:
        run_worker(launch, host, port, args.log_level, step_gate=gate, replica_token=token,
                   stall_timeout_s=args.stall_timeout_s)
    finally:
        if gate is not None:
            gate.close()
    return 0
