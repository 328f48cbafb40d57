"""How co-located replicas share a device: inventory, a pure planner, the applier and the time-slice arbiter.

- `inventory.read_inventory(backend)` -> `Inventory` (through `nvml_backend.NvmlBackend`, the only code importing
  `pynvml`, or `fake_backend.FakeBackend` over a `partitioner/inventories/*.json` file; no NVML -> a CPU inventory).
- `demand.replica_demands(registry, shapes)` -> `ReplicaDemand`s (memory = weights + KV budget + overhead).
- `planner.plan(inventory, demands, PlanOptions(...))` -> `plan.Plan`, or raises `plan.InfeasiblePlan`.
- `apply_plan.decide(plan, inventory, applied_state)` -> actions; `applier.reconcile(...)` executes them (MIG via
  the backend, MPS via a `commands.CommandRunner`), with the MIG fallback.
- `arbiter.TimeSliceArbiter` (the pure core), `arbiter_service.ArbiterService` (per shared device, Unix socket),
  `arbiter_client.LeaseClient` (a worker's step gate); `placer.ReplicaPlacer` is the pool's `env_for`.
- `cli.add_partition_parser`: `multiserve partition plan|apply|status`.

Nothing is imported here, so `import partitioner.x` stays cheap and never loads NVML.
"""
