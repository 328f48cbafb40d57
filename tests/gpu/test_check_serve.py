"""The serve check's parts that need no GPU: it runs the gateway read-only on the devices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gpu.check_serve import serve_argv


def test_the_gateway_is_started_without_applying_a_partition(tmp_path: Path):
    """`--apply-partition auto` (serve's default) would create MIG devices as root on a MIG host: the check must never
    change a device."""
    argv = serve_argv(tmp_path / "registry.yaml")
    assert argv[argv.index("--apply-partition") + 1] == "no"
    # and serve takes that argument as it is written here
    help_text = subprocess.run([sys.executable, "-m", "multiserve", "serve", "--help"], capture_output=True,
                               text=True, timeout=60, check=True).stdout
    assert "--apply-partition" in help_text and "no" in help_text
