"""The applier: reconcile the host's devices to a plan. Decide (`actions.decide`), then execute, here.

MIG devices are created and destroyed through the backend (NVML: privileged); MPS daemons are started, given
their defaults and stopped through a `CommandRunner` (`nvidia-cuda-mps-control`). Everything done is written
to the applied-state file as it happens, so a later apply knows what is ours to undo. A daemon for a MIG device
created in the same run is started on that device's new UUID (its action names the device by its placeholder).

On a failure the applier stops; what it did stays done and recorded, and the next apply carries on from there.
With `rollback=True` it undoes instead what this run created (daemons it started, MIG devices it made), newest
first, so the devices are as they were apart from what it freed; nothing it did not create is touched.

`reconcile` is the whole operation: plan, decide, execute; when MIG cannot be applied (MIG mode off, or NVML
NoPermission) and a fallback is configured, it re-plans the `mig` replicas as `mps` or `timeslice` and applies
that instead, saying why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from partitioner.applying.actions import DEFAULT_MPS_LOG_ROOT, Action, ApplyError, MigUnavailable, decide
from partitioner.applying.applied_state import AppliedStateFile, MpsDaemonState
from partitioner.applying.commands import CommandRunner
from partitioner.devices.backend import DeviceError, MigControl
from partitioner.devices.inventory import Inventory
from partitioner.planning.demand import ReplicaDemand
from partitioner.planning.placement import PlanOptions
from partitioner.planning.plan import PENDING_MIG, Plan, pending_mig_ref
from partitioner.planning.planner import plan

_MIG_HINTS = {
    "no_permission": "creating or destroying MIG devices needs root: run `multiserve partition apply` as root, "
                     "or configure a fallback (--mig-fallback mps|timeslice)",
    "in_use": "processes still run on it: stop them (or drain those replicas) and apply again",
    "insufficient_resources": "the slots are taken: the GPU changed since the plan was made; apply again to re-plan",
}


class Applier:
    """Executes actions in order; the first failure stops it with an `ApplyError` (what was done stays done
    and recorded, or with `rollback`, what this run created is undone)."""

    def __init__(self, mig: MigControl, runner: CommandRunner, state_file: AppliedStateFile,
                 rollback: bool = False) -> None:
        self.mig = mig
        self.runner = runner
        self.state_file = state_file
        self.rollback = rollback

    def execute(self, actions: Sequence[Action]) -> dict[str, str]:
        """Run `actions`; returns replica id -> UUID of the MIG device created for it (each replica of a shared
        instance gets the instance's)."""
        created: dict[str, str] = {}
        new_devices: dict[str, str] = {}  # placeholder -> UUID of the MIG devices made so far
        done: list[Action] = []
        for action in actions:
            try:
                if action.kind in ("create_mig_device", "destroy_mig_device"):
                    uuid = self._mig(action)
                    if uuid is not None:
                        new_devices[pending_mig_ref(str(action.profile), action.start)] = uuid
                        created |= {rid: uuid for rid in action.clients or (action.replica_id,) if rid is not None}
                        action = dataclasses.replace(action, uuid=uuid)
                else:
                    action = _on_created_device(action, new_devices)
                    self._mps(action)
            except ApplyError as exc:
                if not self.rollback:
                    raise
                raise type(exc)(f"{exc}{self._undo(done)}") from None
            done.append(action)
        return created

    def _undo(self, done: list[Action]) -> str:
        """Undo what this run created, newest first; what it says about that, for the error message."""
        undo = [_undo_action(a) for a in reversed(done) if a.kind in ("create_mig_device", "start_mps_daemon")]
        undone: list[str] = []
        for action in undo:
            try:
                if action.kind == "destroy_mig_device":
                    self._mig(action)
                else:
                    self._mps(action)
            except ApplyError as exc:
                kept = f"; kept {', '.join(undone)}" if undone else ""
                return f". Rolling back failed: {exc}{kept}; what is left is recorded in {self.state_file.path}"
            undone.append(f"destroyed MIG device {action.uuid}" if action.kind == "destroy_mig_device" else
                          f"stopped the MPS daemon of {action.pipe_directory}")
        return f". Rolled back: {'; '.join(undone)}" if undone else ". Nothing was created, nothing to roll back"

    def _mig(self, action: Action) -> str | None:
        state = self.state_file.load()
        try:
            if action.kind == "destroy_mig_device":
                assert action.uuid is not None
                self.mig.destroy_mig_device(action.gpu_index, action.uuid)
                state.mig_devices.pop(action.uuid, None)
                uuid = None
            else:
                assert action.profile is not None and action.start is not None
                uuid = self.mig.create_mig_device(action.gpu_index, action.profile, action.start).uuid
                state.mig_devices[uuid] = action.gpu_index
        except DeviceError as exc:
            message = f"{action.describe()}: failed: {exc}; {_MIG_HINTS.get(exc.kind, 'see the NVML error')}"
            raise (MigUnavailable if exc.kind == "no_permission" else ApplyError)(message) from None
        self.state_file.save(state)
        return uuid

    def _mps(self, action: Action) -> None:
        command = action.command()
        assert command is not None and action.pipe_directory is not None
        argv, env, stdin = command
        if action.kind == "start_mps_daemon":
            for directory in (action.pipe_directory, action.log_directory):
                Path(str(directory)).mkdir(parents=True, exist_ok=True)
        try:
            result = self.runner.run(argv, env, stdin)
        except OSError as exc:  # no such program: the host has no MPS
            raise ApplyError(f"{action.describe()}: cannot run {argv[0]}: {exc}") from None
        if result.returncode != 0:
            output = (result.stderr or result.stdout).strip()
            raise ApplyError(f"{action.describe()}: exit status {result.returncode}: {output or '(no output)'}")
        self._record_mps(action)

    def _record_mps(self, action: Action) -> None:
        state = self.state_file.load()
        pipe = str(action.pipe_directory)
        if action.kind == "stop_mps_daemon":
            state.mps_daemons.pop(pipe, None)
        elif action.kind == "start_mps_daemon":
            state.mps_daemons[pipe] = MpsDaemonState(action.gpu_index, str(action.uuid), str(action.log_directory))
        else:
            daemon = state.mps_daemons.setdefault(pipe, MpsDaemonState(action.gpu_index, str(action.uuid), ""))
            key = str(action.setting).rsplit(" ", 1)[0]  # a new value replaces the old one of the same setting
            daemon.settings = [s for s in daemon.settings if s.rsplit(" ", 1)[0] != key] + [str(action.setting)]
        self.state_file.save(state)


def _on_created_device(action: Action, new_devices: dict[str, str]) -> Action:
    """`action` (an MPS one) aimed at the MIG device its placeholder stands for, created earlier in this run."""
    if action.uuid is None or not action.uuid.startswith(PENDING_MIG):
        return action
    if action.uuid not in new_devices:
        raise ApplyError(f"{action.describe()}: its MIG device {action.uuid} was not created by this apply; "
                         f"apply again to re-plan")
    return dataclasses.replace(action, uuid=new_devices[action.uuid])


def _undo_action(action: Action) -> Action:
    """What reverses `action`: a MIG device created is destroyed, a daemon started is told to quit."""
    if action.kind == "create_mig_device":
        return Action("destroy_mig_device", action.gpu_index, uuid=action.uuid)
    return Action("stop_mps_daemon", action.gpu_index, uuid=action.uuid, pipe_directory=action.pipe_directory)


@dataclass
class ApplyOutcome:
    """What `reconcile` planned and did (or, dry, would do)."""

    plan: Plan
    actions: list[Action]
    created: dict[str, str] = field(default_factory=dict)  # replica id -> new MIG device UUID
    fallback_reason: str | None = None  # why the mig replicas were re-planned with the fallback


def reconcile(read_inventory: Callable[[], Inventory], demands: Sequence[ReplicaDemand], options: PlanOptions,
              applier: Applier, dry_run: bool = False, mps_log_root: str = DEFAULT_MPS_LOG_ROOT) -> ApplyOutcome:
    """Plan, decide and (unless `dry_run`) execute. Raises `InfeasiblePlan` or `ApplyError` (a `MigUnavailable`
    only when no fallback is configured)."""
    inventory = read_inventory()
    first = plan(inventory, demands, options)
    try:
        return _apply(first, inventory, applier, dry_run, mps_log_root)
    except MigUnavailable as exc:
        if options.mig_fallback is None:
            raise
        reason = str(exc)
    fallback = options.mig_fallback
    shared = any(d.mig_instance is not None for d in demands)
    demands = [dataclasses.replace(d, isolation=fallback) if d.isolation == "mig" else
               dataclasses.replace(d, mig_instance=None) for d in demands]
    inventory = read_inventory()  # what the failed attempt left (a permission error changes nothing)
    outcome = _apply(plan(inventory, demands, options), inventory, applier, dry_run, mps_log_root)
    outcome.fallback_reason = (f"{reason}. Fallback: the mig replicas run with {fallback} isolation instead"
                               + (", and those that shared a MIG instance share a whole GPU" if shared else ""))
    return outcome


def _apply(planned: Plan, inventory: Inventory, applier: Applier, dry_run: bool, mps_log_root: str) -> ApplyOutcome:
    actions = decide(planned, inventory, applier.state_file.load(), mps_log_root)
    created = {} if dry_run else applier.execute(actions)
    return ApplyOutcome(planned, actions, created)
