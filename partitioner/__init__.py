"""How co-located replicas share a device: inventory, a pure planner, and (next) the applier and time-slice arbiter.

- `inventory.read_inventory(backend)` -> `Inventory` (through `nvml_backend.NvmlBackend`, the only code importing
  `pynvml`, or `fake_backend.FakeBackend` over a `configs/inventories/*.json` file; no NVML -> a CPU inventory).
- `demand.replica_demands(registry, shapes)` -> `ReplicaDemand`s (memory = weights + KV budget + overhead).
- `planner.plan(inventory, demands, PlanOptions(...))` -> `plan.Plan`, or raises `plan.InfeasiblePlan`.
- `cli.add_partition_parser`: `multiserve partition plan|status`.

Nothing is imported here, so `import partitioner.x` stays cheap and never loads NVML.
"""
