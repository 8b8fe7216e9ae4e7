"""The one thing pyproject.toml cannot say: the packages, found rather than listed. Every
folder of supervisor/ and proxy/ with an __init__.py ships under its import name
(corral.supervisor.*, corral.proxy.*; pyproject.toml's package-dir maps the folders), so a new
subpackage cannot be left out of the wheel. tests/test_packaging.py builds and installs it."""

from setuptools import find_packages, setup

FOLDERS = ("supervisor", "proxy")

setup(packages=[
    *(f"corral.{name}" for name in find_packages(
        include=[pattern for folder in FOLDERS for pattern in (folder, f"{folder}.*")])),
    "corral.proxy.static",  # the status page: data only, no __init__.py
])
