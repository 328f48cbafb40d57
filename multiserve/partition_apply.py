"""`multiserve partition apply [--dry-run]`.

Exit status as for `plan`: 0 done (also when a MIG fallback was applied: a warning says why); 1 the plan is
infeasible or an action failed (the message says which and what to do); 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from multiserve.partition_cli import add_plan_arguments, plan_inputs, plan_inputs_or_exit_code, render_plan
from partitioner.applying.actions import DEFAULT_MPS_LOG_ROOT, ApplyError
from partitioner.applying.applied_state import DEFAULT_STATE_FILE, AppliedStateFile
from partitioner.applying.commands import CommandResult, CommandRunner, SubprocessRunner
from partitioner.devices.backend import DeviceError, MigControl
from partitioner.devices.inventory import Inventory, InventoryFileError, MigDevice
from partitioner.devices.read import load_host_inventory, read_inventory
from partitioner.planning.plan import InfeasiblePlan

if TYPE_CHECKING:
    from partitioner.devices.nvml_backend import NvmlBackend
    from partitioner.planning.demand import ModelShape
    from partitioner.planning.placement import PlanOptions
    from registry.schema import Registry


def add_apply_parser(actions: argparse._SubParsersAction, default_config: Path) -> None:
    apply = actions.add_parser("apply", help="make the devices match the plan (MIG devices, MPS daemons); "
                                             "--dry-run prints every action and runs none")
    add_plan_arguments(apply, default_config)
    apply.add_argument("--dry-run", action="store_true", help="print every action; change nothing")
    apply.add_argument("--state-file", default=DEFAULT_STATE_FILE,
                       help="where apply records what it created (only that is ever destroyed or stopped)")
    apply.add_argument("--mps-log-root", default=DEFAULT_MPS_LOG_ROOT,
                       help="one MPS log directory per daemon below it (per GPU, or per shared MIG device)")
    apply.add_argument("--rollback-on-failure", action="store_true",
                       help="when an action fails, undo what this apply created (MIG devices, MPS daemons) instead "
                            "of keeping it for the next apply to finish")
    apply.set_defaults(func=run_apply)


class _PrintOnlyRunner:
    """For a fake inventory: MPS commands are shown, never run (they would act on this machine)."""

    def run(self, argv: Sequence[str], env: Mapping[str, str], input_text: str | None = None) -> CommandResult:
        return CommandResult(0)


class _NvmlMig:
    """The NVML backend, opened on the first MIG change only (a plan without MIG never needs NVML's write side)."""

    def __init__(self) -> None:
        from partitioner.devices.nvml_backend import NvmlBackend

        self.backend: NvmlBackend = NvmlBackend()
        self.opened = False

    def _open(self) -> NvmlBackend:
        if not self.opened:
            self.backend.open()
            self.opened = True
        return self.backend

    def create_mig_device(self, index: int, profile: str, start: int) -> MigDevice:
        return self._open().create_mig_device(index, profile, start)

    def destroy_mig_device(self, index: int, uuid: str) -> None:
        self._open().destroy_mig_device(index, uuid)

    def close(self) -> None:
        if self.opened:
            self.backend.close()


def run_apply(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
              env: Mapping[str, str] | None = None, runner: CommandRunner | None = None) -> int:
    """`partition apply`: plan, then reconcile the devices to it (or, with --dry-run, say how)."""
    out, err, env = out or sys.stdout, err or sys.stderr, os.environ if env is None else env
    inputs = plan_inputs_or_exit_code(args, env, err)
    if isinstance(inputs, int):
        return inputs
    return _apply(args, inputs, out, err, env, runner)


def _apply(args: argparse.Namespace, inputs: tuple[Registry, dict[str, ModelShape], Inventory, PlanOptions],
           out: TextIO, err: TextIO, env: Mapping[str, str], runner: CommandRunner | None) -> int:
    """Reconcile the devices to the plan of `inputs` (what `plan_inputs` read) and report what was done."""
    from partitioner.applying.applier import Applier, reconcile
    from partitioner.planning.demand import replica_demands

    registry, shapes, inventory, options = inputs
    with tempfile.TemporaryDirectory() as scratch:
        mig, read, runner, state_path = _targets(args, inventory, env, runner, Path(scratch))
        try:
            outcome = reconcile(read, replica_demands(registry, shapes), options,
                                Applier(mig, runner, AppliedStateFile(state_path), rollback=args.rollback_on_failure),
                                args.dry_run, args.mps_log_root)
        except InfeasiblePlan as exc:
            print(f"error: infeasible plan for {args.config} on {inventory.source}:", file=err)
            err.writelines(f"  - {problem}\n" for problem in exc.problems)
            return 1
        except (ApplyError, DeviceError) as exc:
            print(f"error: apply failed: {exc}", file=err)
            return 1
        finally:
            if isinstance(mig, _NvmlMig):
                mig.close()
    if outcome.fallback_reason:
        print(f"warning: {outcome.fallback_reason}", file=err)
    head = "dry run: would run" if args.dry_run else "applied"
    lines = [f"{head} {len(outcome.actions)} action(s)" + (":" if outcome.actions else " (the devices match)")]
    lines += [f"  - {a.describe()}" for a in outcome.actions]
    lines += [f"  {rid}: CUDA_VISIBLE_DEVICES={uuid}" for rid, uuid in sorted(outcome.created.items())]
    out.write("\n".join(lines) + "\n\n" + render_plan(outcome.plan))
    return 0


def prepare_devices(config: str | Path, mode: str, env: Mapping[str, str] | None = None, err: TextIO | None = None,
                    inventory_file: str | None = None, runner: CommandRunner | None = None,
                    euid: int | None = None) -> int:
    """`serve --apply-partition`: before any replica starts, make the devices what the registry's plan needs (as
    `partition apply` would, with serve's plan options). Returns 0 to go on serving, else the exit status.

    `mode` "no" changes nothing; "yes" applies; "auto" applies unless the plan creates MIG devices and this
    process is not root. Whatever is left unapplied, serve's registry check refuses, naming the changes and the
    command that makes them: no replica ever starts half-isolated."""
    env, err = os.environ if env is None else env, err or sys.stderr
    from partitioner.planning.demand import replica_demands
    from partitioner.planning.placement import PlanOptions
    from partitioner.planning.planner import plan
    from registry.errors import RegistryError

    if mode == "no":
        return 0
    args = argparse.Namespace(config=str(config), shapes=None, inventory=inventory_file, gpus=None, mig_fallback=None,
                              max_memory_fraction=PlanOptions().max_memory_fraction, dry_run=False,
                              state_file=DEFAULT_STATE_FILE, mps_log_root=DEFAULT_MPS_LOG_ROOT,
                              rollback_on_failure=False)
    try:
        inputs = plan_inputs(args, env)
    except (RegistryError, InventoryFileError, ValueError):
        return 0  # a bad registry: serve says what is wrong with it, as it does on a host without GPUs
    except DeviceError as exc:
        print(f"error: reading the devices: {exc}", file=err)
        return 1
    registry, shapes, inventory, options = inputs
    try:
        actions = plan(inventory, replica_demands(registry, shapes), options).actions()
    except InfeasiblePlan:
        return 0  # serve's registry check refuses it, with the planner's reasons
    if not actions:
        return 0
    root = (os.geteuid() if euid is None else euid) == 0
    if mode == "auto" and not root and any(a.kind != "start_mps_daemon" for a in actions):
        print("note: the plan needs MIG changes, which need root; not applying them (--apply-partition auto)",
              file=err)
        return 0
    return _apply(args, inputs, err, err, env, runner)  # what was read and planned above, not read again


def _targets(args: argparse.Namespace, inventory: Inventory, env: Mapping[str, str], runner: CommandRunner | None,
             scratch: Path) -> tuple[MigControl, Any, CommandRunner, Path]:
    """What apply acts on: this host (NVML, real commands, the state file), or a fake inventory's in-memory GPUs
    (commands only printed, state in a scratch file) when --inventory names one."""
    first = [inventory]  # the inventory plan_inputs already read serves the first plan

    if args.inventory is not None:
        from partitioner.devices.fake_backend import FakeBackend

        fake = FakeBackend.from_file(args.inventory)
        return (fake, lambda: first.pop() if first else read_inventory(fake), runner or _PrintOnlyRunner(),
                scratch / "state.json")
    return (_NvmlMig(), lambda: first.pop() if first else load_host_inventory(None, env),
            runner or SubprocessRunner(env), Path(args.state_file))
