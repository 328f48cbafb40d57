"""How co-located replicas share a device, in four stages.

- `devices/`: `read.read_inventory(backend)` -> `inventory.Inventory` (through `nvml_backend.NvmlBackend`, the only
  code importing `pynvml`, or `fake_backend.FakeBackend` over a `configs/inventories/*.json` file; no NVML -> a
  CPU inventory); `read.load_host_inventory` picks the backend.
- `planning/`: `demand.replica_demands(registry, shapes)` -> `ReplicaDemand`s (memory = weights + KV budget +
  overhead); `planner.plan(inventory, demands, PlanOptions(...))` -> `plan.Plan`, or raises `plan.InfeasiblePlan`;
  `placer.ReplicaPlacer.place` -> each replica's `registry.launch.ReplicaPlacement` and the arbiter it needs, as plain
  data (it opens no socket).
- `applying/`: `actions.decide(plan, inventory, applied_state)` -> actions; `applier.reconcile(...)` executes them
  (MIG via the backend, MPS via a `commands.CommandRunner`), with the MIG fallback. `placements.PlacementApplier`,
  wrapping a `ReplicaPlacer`, is the pool's `placement_for`: it hands out the placements and starts the arbiter
  services they name.
- `timeslice/`: `arbiter.TimeSliceArbiter` (the pure core), `service.ArbiterService` (per shared device, Unix
  socket), `client.LeaseClient` (a worker's step gate).

The `multiserve partition plan|apply|status` commands live in multiserve/. Nothing is imported here, so
`import partitioner.x` stays cheap and never loads NVML.
"""
