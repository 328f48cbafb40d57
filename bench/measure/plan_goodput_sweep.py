"""The simulator's best plan against static MIG partitioning as the load grows and as arrivals get burstier: the
documented three-model H200 example (configs/examples/h200-three-models/) with every model's request rate
multiplied by each `--scales` factor, and its arrival gaps' coefficient of variation set to each `--cvs` value (1:
Poisson; larger: bursty, as vLLM's `--burstiness` = 1/cv²). Everything else (lengths, SLOs, shapes, inventory) is the
example's. Pure simulation: it runs on any machine in about a minute.

    python -m bench.measure.plan_goodput_sweep [--plot sweep.png]

For each point: every candidate plan simulated (`partition simulate`'s candidates), the best by goodput, static MIG
(the memory-sized all-MIG plan), and the ratio of their goodputs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from foundation.config_files import config_path
from partitioner.devices.inventory import Inventory
from partitioner.devices.read import load_host_inventory
from partitioner.planning.demand import ReplicaDemand, load_shapes, replica_demands
from partitioner.planning.placement import PlanOptions
from partitioner.simulate.evaluate import best, evaluate_candidates, sim_models, static_mig
from partitioner.simulate.simulator import SimModel
from partitioner.simulate.traffic import Traffic, load_traffic
from registry.store import load_registry

EXAMPLE = config_path("examples", "h200-three-models")
INVENTORY = config_path("inventories", "h200-141gb.json")


@dataclass(frozen=True)
class Point:
    scale: float
    cv: float
    offered_per_s: float
    best_name: str
    best_goodput: float
    static_goodput: float

    @property
    def ratio(self) -> float:
        return self.best_goodput / self.static_goodput if self.static_goodput > 0 else float("inf")


def scaled(traffic: Traffic, scale: float, cv: float) -> Traffic:
    """`traffic` with every model's rate times `scale` and its gaps' coefficient of variation `cv`."""
    return replace(traffic, models={m: replace(t, rate_per_s=t.rate_per_s * scale, arrival_cv=cv)
                                    for m, t in traffic.models.items()})


@dataclass(frozen=True)
class Example:
    """The example's planning inputs, read once: what every point shares."""

    inventory: Inventory
    demands: list[ReplicaDemand]
    models: dict[str, SimModel]
    traffic: Traffic

    @classmethod
    def load(cls) -> Example:
        registry = load_registry(EXAMPLE / "registry.yaml")
        shapes = load_shapes(EXAMPLE / "shapes.json")
        return cls(load_host_inventory(str(INVENTORY), {}), replica_demands(registry, shapes),
                   sim_models(registry, shapes), load_traffic(EXAMPLE / "traffic.yaml"))


def run_point(example: Example, scale: float, cv: float) -> Point:
    load = scaled(example.traffic, scale, cv)
    evaluated = evaluate_candidates(example.inventory, example.demands, example.models, load, PlanOptions())
    top, static = best(evaluated), static_mig(evaluated)
    assert top is not None and static is not None, "the example always has a feasible best and static MIG plan"
    return Point(scale, cv, sum(t.rate_per_s for t in load.models.values()), top.candidate.name,
                 top.goodput_per_s, static.goodput_per_s)


def plot(points: list[Point], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, cv in enumerate(sorted({p.cv for p in points})):
        mine, color = [p for p in points if p.cv == cv], f"C{i}"  # one colour per cv, in both panels
        xs = [p.offered_per_s for p in mine]
        left.plot(xs, [p.best_goodput for p in mine], marker="o", color=color, label=f"best plan, cv {cv:g}")
        left.plot(xs, [p.static_goodput for p in mine], marker="x", linestyle="--", color=color,
                  label=f"static MIG, cv {cv:g}")
        right.plot(xs, [p.ratio for p in mine], marker="o", color=color, label=f"cv {cv:g}")
    left.set(xlabel="offered requests/s (all models)", ylabel="goodput (requests/s within SLO)",
             title="Goodput, simulated on one H200")
    right.axhline(1.8, color="grey", linestyle=":", label="1.8x")
    right.set(xlabel="offered requests/s (all models)", ylabel="best / static MIG", title="Goodput ratio")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", default="0.5,1,1.5,2,3", help="load multipliers, comma-separated")
    parser.add_argument("--cvs", default="1,2,4", help="arrival gaps' coefficients of variation, comma-separated")
    parser.add_argument("--plot", type=Path, help="write the two curves as a PNG here")
    args = parser.parse_args(argv)
    example = Example.load()
    grid = [(float(s), float(c)) for c in args.cvs.split(",") for s in args.scales.split(",")]
    points = [run_point(example, s, c) for s, c in tqdm(grid, desc="simulating", unit="point")]
    print("| load × | arrival cv | offered req/s | best plan | best goodput/s | static MIG goodput/s | best / static |")
    print("|---|---|---|---|---|---|---|")
    for p in points:
        print(f"| {p.scale:g} | {p.cv:g} | {p.offered_per_s:.1f} | {p.best_name} | {p.best_goodput:.2f} | "
              f"{p.static_goodput:.2f} | {p.ratio:.2f}× |")
    if args.plot:
        print(f"plot: {plot(points, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
