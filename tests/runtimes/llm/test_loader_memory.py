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
from runtimes.llm.model import LlamaForCausalLM

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

cfg = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                  num_kv_heads=8, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True)
shapes = {"embed_tokens.weight": (4096, 512), "norm.weight": (512,)}
for i in range(cfg.num_layers):
    for norm in ("input_layernorm", "post_attention_layernorm"):
        shapes[f"layers.{i}.{norm}.weight"] = (512,)
    for proj in ("q", "k", "v", "o"):
        shapes[f"layers.{i}.self_attn.{proj}_proj.weight"] = (512, 512)
    for proj, shape in (("gate", (2048, 512)), ("up", (2048, 512)), ("down", (512, 2048))):
        shapes[f"layers.{i}.mlp.{proj}_proj.weight"] = shape
tensors = ((name, torch.randn(shape)) for name, shape in shapes.items())
with torch.device("meta"):  # torch's one-time set-up (~150 MB) is not the loader's
    LlamaForCausalLM(cfg)
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
