"""The registry check for `launcher: ray` models, against a stand-in cluster (the real one: tests/e2e/test_ray_e2e.py):
an unreachable cluster, or resources no node has, are refused naming the field; what fits passes."""

from __future__ import annotations

from typing import Any

from model_pool.ray_launcher import RayUnavailable, ray_problems
from registry.store import parse_registry

NODES = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "memory": 32.0 * (1 << 30),
                                                                          "node:10.0.0.1": 1.0}},
         {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 4.0, "GPU": 1.0, "a100": 1.0}},
         {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 64.0, "GPU": 8.0}}]


class Cluster:
    def __init__(self, nodes: list[dict[str, Any]] | None = None, error: str | None = None) -> None:
        self._nodes, self.error = nodes, error

    def nodes(self) -> list[dict[str, Any]]:
        if self.error is not None:
            raise RayUnavailable(self.error)
        return [n for n in self._nodes or [] if n["Alive"]]


def registry(ray: str, launcher: str = "ray") -> Any:
    head = "gateway: {model_roots: [/]}\nmodels:\n"
    if launcher == "ray":
        return parse_registry(f"{head}  - {{name: m, type: chat, source: {{path: /m}}, launcher: ray, ray: {ray}}}\n",
                              "r.yaml")
    return parse_registry(f"{head}  - {{name: m, type: chat, source: {{path: /m}}}}\n", "r.yaml")


def test_resources_some_alive_node_has_pass():
    for ray in ("{num_cpus: 8, memory_gib: 16}", "{num_gpus: 0.5, resources: {a100: 1}}", "{}"):
        assert ray_problems(registry(ray), Cluster(NODES)) == []  # type: ignore[arg-type]


def test_resources_no_alive_node_has_are_refused_naming_what_each_node_has():
    [problem] = ray_problems(registry("{num_gpus: 2}"), Cluster(NODES))  # type: ignore[arg-type]
    assert problem.field == "models[0].ray"
    assert problem.message.startswith("no node of the Ray cluster has CPU 1, GPU 2 for one replica of 'm'; nodes: "
                                      "10.0.0.1: CPU 8, memory 32.0 GiB; 10.0.0.2: CPU 4, GPU 1, a100 1")
    # (the dead node's 8 GPUs do not count) and one node must have it all, not the cluster in sum
    assert ray_problems(registry("{num_cpus: 6, num_gpus: 1}"), Cluster(NODES))  # type: ignore[arg-type]


def test_an_unreachable_cluster_is_a_problem_of_the_address_and_no_ray_model_needs_none():
    [problem] = ray_problems(registry("{}"), Cluster(error="cannot connect to the Ray cluster at 'h:6379': refused")
                             )  # type: ignore[arg-type]
    assert (problem.field, problem.message) == ("gateway.ray.address",
                                              "cannot connect to the Ray cluster at 'h:6379': refused")
    assert ray_problems(registry("", launcher="local"), Cluster(error="unused")) == []  # type: ignore[arg-type]
