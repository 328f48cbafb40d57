"""What pyproject.toml cannot say: a wheel carries the top-level configs/ folder (what an operator edits) as the
package `foundation.configs`, beside foundation/config_files.py which finds it. Only a listed package can be mapped to
another folder, and pyproject.toml cannot list one beside `packages.find`; so the packages are found here, as
`packages.find` would, with that one added. Its files are package data in pyproject.toml."""

from setuptools import find_packages, setup

TOP_LEVEL = ("bench", "foundation", "gateway", "model_pool", "multiserve", "partitioner", "policies", "registry",
             "runtimes")

setup(
    packages=[*find_packages(include=[p for name in TOP_LEVEL for p in (name, f"{name}.*")]), "foundation.configs"],
    package_dir={"foundation.configs": "configs"},
)
