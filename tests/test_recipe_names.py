"""Shipped recipes run by name from anywhere, and an installed package carries them.

References: the files in the checkout's recipes/ (what must be shipped), pyproject.toml's
package list against the package folders on disk, and a wheel built from the checkout.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.recipe.find import find_recipe

from .helpers import skip_unless_ci

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))


def test_a_recipe_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./recipes here
    assert find_recipe(Path("quickstart")).read_bytes() == (ROOT / "recipes" / "quickstart.yaml").read_bytes()
    assert find_recipe(Path("quickstart.yaml")).name == "quickstart.yaml"
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "quickstart.yaml").write_text("name: mine\n")  # ./recipes comes first
    assert find_recipe(Path("quickstart")) == Path.cwd() / "recipes" / "quickstart.yaml"
    assert find_recipe(Path("some/file.yaml")) == Path("some/file.yaml")  # a path stays a path


def test_recipes_lists_and_shows_the_shipped_ones_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    listed = runner.invoke(app, ["recipes"], terminal_width=300)
    assert listed.exit_code == 0, listed.output
    assert all(name in listed.output for name in SHIPPED)
    shown = runner.invoke(app, ["recipes", "--show", "quickstart"])
    assert shown.exit_code == 0 and shown.output == (ROOT / "recipes" / "quickstart.yaml").read_text()
    missing = runner.invoke(app, ["run", "no-such-recipe", "--dry-run"])
    assert missing.exit_code == 1 and "neither a file nor the name of a recipe" in missing.output
    dry = runner.invoke(app, ["run", "quickstart", "--dry-run"])
    assert dry.exit_code == 0 and "would train transe" in dry.output


def test_every_package_folder_is_listed_for_installation():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    mapped = {folder.replace("/", "."): package for package, folder in setuptools["package-dir"].items()}
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dsa_train").rglob("__init__.py")}
    installed = {mapped.get(folder, folder) for folder in on_disk}  # dsa_train/dsa_alias/ installs as dsa
    assert "dsa" in installed
    assert installed <= listed and listed - installed == {"dsa_train.recipes"}


def can_build_wheels_offline() -> bool:
    """setuptools with its own bdist_wheel (70.1 and later), or with the wheel package."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    return (
        importlib.util.find_spec("wheel") is not None
        or importlib.util.find_spec("setuptools.command.bdist_wheel") is not None
    )


def test_a_wheel_carries_the_recipes_and_the_kernel_source(tmp_path):
    """Skips on a developer's machine without pip or setuptools; fails in CI, where the test
    extra installs setuptools (and .ci/run's venv has pip)."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        skip_unless_ci("no pip in this environment")
    if not can_build_wheels_offline():
        skip_unless_ci(
            "building the wheel offline (--no-build-isolation) needs setuptools >= 70.1 (or wheel) here; "
            "Python >= 3.12 venvs have none: pip install setuptools (the test extra installs it)"
        )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[
        -2000:
    ]  # with pip and setuptools here, a wheel that does not build is a broken package
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert {f"dsa_train/recipes/{name}.yaml" for name in SHIPPED} <= set(names)
    assert "dsa_train/optim/sparse_adam_rows.c" in names
    assert "dsa/__init__.py" in names  # from dsa import DiskSparseAdam, as the seed writes it
