"""`multiserve worker`: one replica's process, assembled from its parts. The engine and its HTTP face come from
runtimes/, the device share from the partitioner's plan entry (the environment the pool launched it with), the
time-slice lease from the partitioner's arbiter client, and the launch token from the gateway's launcher."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from partitioner.planning.worker_env import worker_settings
from runtimes.llm.config import EngineConfig
from runtimes.server.wire import REPLICA_TOKEN_ENV
from runtimes.server.worker import parse_engine_json, run_worker


def run_worker_command(args: argparse.Namespace) -> int:
    """Serve one replica until SIGTERM; 2 on bad options or plan entry (the message says which)."""
    try:
        config = parse_engine_json(args.engine_json, args.device, args.type)
    except ValueError as err:  # json.JSONDecodeError included
        print(f"error: --engine-json: {err}", file=sys.stderr)
        return 2
    try:
        plan = worker_settings(os.environ)  # the partitioner's plan entry, from the pool
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if plan.kv_cache_bytes is not None and isinstance(config, EngineConfig) and config.kv_cache_bytes is None:
        config = dataclasses.replace(config, kv_cache_bytes=plan.kv_cache_bytes)
    gate = None
    if plan.arbiter_socket:  # the device is time-shared: every engine step takes the arbiter's lease
        from partitioner.timeslice.client import LeaseClient

        gate = LeaseClient(plan.arbiter_socket, plan.arbiter_client or args.name, plan.arbiter_weight)
    token = os.environ.pop(REPLICA_TOKEN_ENV, None) or None  # not passed on to anything this process starts
    try:
        run_worker(args.source, args.name, args.alias, args.host, args.port, config, args.log_level,
                   model_type=args.type, step_gate=gate, memory_fraction=plan.memory_fraction,
                   replica_token=token, stall_timeout_s=args.stall_timeout_s)
    finally:
        if gate is not None:
            gate.close()
    return 0
