"""The wheel's layout: the code packages, and conf/, data/ and models/ packed inside `common` (as common/conf, ...),
so that an install finds its configs and shipped data without putting folders named conf/ or data/ at the top of
site-packages. kernels/ goes in as forge_kernels (forge_kernels/__init__.py says why). pyproject.toml cannot map
folders into a package while it finds the packages; the metadata is there."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

CODE = ["common", "forge_kernels", "speculators", "inference", "engines", "train", "benchmarks"]
ASSETS = {"common.conf": "conf", "common.data": "data", "common.models": "models"}


class BuildPy(build_py):
    """forge_kernels in the wheel: forge_kernels/__init__.py with kernels/' modules and C++ source beside it (the
    C++ compiled on first use). An editable install needs none: forge_kernels/__init__.py reaches kernels/."""

    def run(self):
        super().run()
        if self.editable_mode:
            return
        for source in sorted(Path("kernels").glob("*.py")) + sorted(Path("kernels").glob("*.cpp")):
            self.copy_file(str(source), str(Path(self.build_lib, "forge_kernels", source.name)))


setup(
    packages=find_packages(include=[p for name in CODE for p in (name, f"{name}.*")]) + list(ASSETS),
    package_dir=ASSETS,
    package_data={name: ["**/*"] for name in ASSETS},
    cmdclass={"build_py": BuildPy},
)
