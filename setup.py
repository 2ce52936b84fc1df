"""Packaging: each top-level folder of the checkout is one subpackage of the single import root `moechat`.

The subpackages are found, not listed: a new folder with an `__init__.py` needs no edit here.
"""

from setuptools import find_packages, setup

# The folders the product is known by, each installed as moechat.<folder>.
ROOTS = ("app", "engine", "widgets", "tuner", "assets", "demo")

packages = ["moechat"] + [f"moechat.{p}" for p in find_packages(include=[f"{r}*" for r in ROOTS])]
setup(packages=packages, package_dir={"moechat": "moechat", **{f"moechat.{r}": r for r in ROOTS}})
