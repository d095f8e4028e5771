"""The wheel's layout: the code packages, and conf/, data/ and models/ packed inside `common` (as common/conf, ...),
so that an install finds its configs and shipped data without putting folders named conf/ or data/ at the top of
site-packages. pyproject.toml cannot map folders into a package while it finds the packages; the metadata is there."""

from setuptools import find_packages, setup

CODE = ["common", "kernels", "speculators", "inference", "engines", "train", "benchmarks"]
ASSETS = {"common.conf": "conf", "common.data": "data", "common.models": "models"}

setup(
    packages=find_packages(include=[p for name in CODE for p in (name, f"{name}.*")]) + list(ASSETS),
    package_dir=ASSETS,
    package_data={"kernels": ["*.cpp"], **{name: ["**/*"] for name in ASSETS}},  # kernels: compiled on first use
)
