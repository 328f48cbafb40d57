"""The serve check's parts that need no GPU: it runs the gateway read-only on the devices."""

from __future__ import annotations

from pathlib import Path

from multiserve.cli import build_parser
from tests.gpu.check_serve import serve_argv


def test_the_gateway_is_started_without_applying_a_partition(tmp_path: Path):
    """`--apply-partition auto` (serve's default) would create MIG devices as root on a MIG host: the check must never
    change a device."""
    argv = serve_argv(tmp_path / "registry.yaml")
    assert argv[argv.index("--apply-partition") + 1] == "no"
    # and serve parses that argument as it is written here
    args = build_parser().parse_args(argv[argv.index("serve"):])
    assert args.apply_partition == "no"
