"""The wheel: everything installs under the single import root ``rlite``, with the console script.

One wheel is built (offline, no build isolation) from a copy of the sources, so the checkout is not
touched, then installed into a temporary folder and imported from there.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import rlite

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "trainer", "plugins"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif (ROOT / name).is_file():
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    # --skip-dependency-check: the backend is the venv's setuptools (>= 70.1 builds wheels without
    # the separate ``wheel`` package that pyproject still lists); nothing is downloaded.
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
         "--outdir", str(dist), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def read_member(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [name for name in archive.namelist() if name.endswith(suffix)]
        return archive.read(member).decode()


def test_everything_installs_under_rlite(names: set[str]) -> None:
    dist_info = f"rlite-{rlite.__version__}.dist-info"
    assert {name.split("/")[0] for name in names} == {"rlite", dist_info}
    for required in (
        "rlite/__init__.py",
        "rlite/__main__.py",
        "rlite/cli.py",
        "rlite/config/schema.py",
        "rlite/api.py",
        "rlite/hookspecs.py",
        "rlite/plugin_manager.py",
        "rlite/engines/base.py",
        "rlite/plugins/__init__.py",
        "rlite/plugins/advantages.py",
        "rlite/plugins/rewards.py",
    ):
        assert required in names


def test_every_source_module_ships(names: set[str]) -> None:
    expected = {
        f"rlite/{p.relative_to(ROOT / 'trainer').as_posix()}" for p in (ROOT / "trainer").rglob("*.py")
    }
    expected |= {
        f"rlite/plugins/{p.relative_to(ROOT / 'plugins').as_posix()}"
        for p in (ROOT / "plugins").rglob("*.py")
    }
    expected |= {
        f"rlite/{p.relative_to(ROOT / 'trainer').as_posix()}"
        for p in (ROOT / "trainer" / "assets").rglob("*")
        if p.is_file()
    }
    assert sorted(expected - names) == [], "add the missing packages to [tool.setuptools] packages"


def test_console_script_and_metadata(wheel: Path) -> None:
    entry_points = configparser.ConfigParser()
    entry_points.read_string(read_member(wheel, ".dist-info/entry_points.txt"))
    assert entry_points["console_scripts"]["rlite"] == "rlite.__main__:main"  # its SIGTERM handler comes first
    metadata = read_member(wheel, ".dist-info/METADATA")
    assert "Name: rlite\n" in metadata and f"Version: {rlite.__version__}\n" in metadata


def test_installed_wheel_imports_and_loads_its_plugins(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--disable-pip-version-check",
    ]
    result = subprocess.run(
        [*install, "--target", str(site), str(wheel)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    script = (
        "import rlite, rlite.cli\n"
        "from rlite.plugin_manager import build_plugin_manager\n"
        "pm = build_plugin_manager(autoload=False)\n"
        "print(rlite.__file__)\n"
        "print(sorted({type(p).__name__ for _, p in pm.list_name_plugin()}))\n"
        "print(sys.modules['rlite.plugins.advantages'].__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(
        [sys.executable, "-c", "import sys\n" + script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    init_file, plugin_types, advantages_file = result.stdout.strip().splitlines()
    assert Path(init_file).is_relative_to(site)
    assert Path(advantages_file).is_relative_to(site)
    assert plugin_types == "['module']"
