"""Planning needs no engine: nothing the planner and the simulator import, inside functions too, reaches torch, and a
process that plans, estimating a model's shape from its GGUF header, never loads it."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf
from tests.test_layers import ROOT, _imports, _modules, _torch_reached_from

PLANNING = ("partitioner.planning", "partitioner.simulate")


def test_no_planning_module_reaches_torch():
    modules = _modules()
    assert _torch_reached_from(PLANNING, modules, _imports(modules)) == {}


def test_planning_with_an_estimated_shape_loads_no_torch(tmp_path):
    gguf = write_gguf(hf_model(TinySpec(), seed=1), tmp_path / "tiny.gguf")
    script = (
        "import json, sys\n"
        "from partitioner.planning.placer import ReplicaPlacer\n"
        "from partitioner.planning.shapes import estimate_shape\n"
        "from partitioner.simulate.simulator import simulate\n"
        f"assert estimate_shape({str(gguf)!r}).num_layers > 0\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'runtimes'))))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert not [m for m in loaded if m.split(".")[0] == "torch"], loaded
    assert set(loaded) <= {"runtimes", "runtimes.llm", "runtimes.llm.model_config", "runtimes.llm.gguf_file"}, loaded
