"""The loader's peak memory: the model is allocated once, in its own dtype, never first in fp32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

# In a fresh process: reset the peak RSS (Linux: /proc/self/clear_refs), load a 38M-parameter model in bf16 from
# fp32 checkpoint tensors made one at a time, and print the peak's growth and the weights' size, in bytes.
_SCRIPT = """
import re, torch
from runtimes.llm.config import ModelConfig
from runtimes.llm.loader import load_state_dict

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

def checkpoint(cfg):
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    for n in range(cfg.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"layers.{n}.{norm}.weight"] = (h,)
        for proj in ("q", "k", "v", "o"):
            shapes[f"layers.{n}.self_attn.{proj}_proj.weight"] = (h, h)
        for proj, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            shapes[f"layers.{n}.mlp.{proj}_proj.weight"] = shape
    return ((name, torch.randn(shape)) for name, shape in shapes.items())

def config(hidden, layers):
    return ModelConfig(vocab_size=8 * hidden, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
                       num_heads=8, num_kv_heads=8, head_dim=hidden // 8, max_position_embeddings=256,
                       tie_word_embeddings=True)

# torch's one-time set-up (its kernels' first use, the allocator's first arenas) is not the loader's: a small model
# first, through the same path
load_state_dict(config(64, 1), checkpoint(config(64, 1)), torch.device("cpu"), torch.bfloat16)
cfg = config(512, 8)
tensors = checkpoint(cfg)
torch.randn(2048, 512)
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
model = load_state_dict(cfg, tensors, torch.device("cpu"), torch.bfloat16)
growth = status("VmHWM") - before
print(growth, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


def test_loading_in_bf16_never_holds_the_model_in_fp32():
    # glibc serves blocks this large from mmap, returned on free: RSS then follows what is alive, not what malloc
    # keeps for reuse after its threshold adapts to the first freed tensor.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, check=True,
                          cwd=REPO_ROOT, env=env)
    growth, weights = map(int, proc.stdout.split())
    assert weights > 64 << 20  # ~71 MB of bf16 weights; fp32 would be twice that
    # The model once in bf16, plus one fp32 checkpoint tensor and one transposed copy in flight (a few MB).
    assert growth < 1.3 * weights, f"peak grew {growth / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"


def test_loading_does_not_pull_in_the_compiler_stack(tmp_path):
    """A CPU load imports neither sympy nor torch._dynamo nor Triton: together ~130 MB resident in every replica
    (operations on meta tensors, where the model is built, can import them through torch's Python references)."""
    from tests.runtimes.llm.tiny import TinySpec, hf_model, save_hf_dir

    path = save_hf_dir(hf_model(TinySpec()), tmp_path)
    script = ("import sys, torch\nfrom runtimes.llm.loader import load_model\n"
              f"load_model({str(path)!r}, torch.device('cpu'), torch.float32, progress=False)\n"
              "print(sorted(m for m in ('sympy', 'torch._dynamo', 'triton') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True,
                          cwd=REPO_ROOT)
    assert proc.stdout.split()[-1] == "[]", proc.stdout
