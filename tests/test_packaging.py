"""The wheel: everything installs under the single import root ``rlite``, with the console script; the
package is publishable (metadata, ``twine check``), and the built wheel trains in a fresh venv.

The sdist and the wheel are built once (``python -m build``, offline: no build isolation) from a copy of
the sources, so the checkout is not touched. The fresh venv gets the wheel by ``pip install`` (no
dependencies: they come from this venv's site-packages through a ``.pth`` line, since installing torch
and transformers again would take minutes and the network) and runs the quickstart's first steps from a
folder holding only the quickstart's config and warm start, so nothing is imported from the checkout.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import rlite

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "CHANGELOG.md", "trainer", "plugins"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, as ``python -m build`` writes them for an upload."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        assert (ROOT / name).exists(), f"{name} is missing: the sdist and the package metadata need it"
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation --skip-dependency-check: the backend is this venv's setuptools; nothing is downloaded
    result = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--skip-dependency-check",
         "--outdir", str(out), str(source)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
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
        "rlite/tools/cli.py",
        "rlite/run/loop.py",
        "rlite/testing/conformance.py",
        "rlite/algorithms/mismatch.py",
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
        "import rlite, rlite.tools.cli\n"
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


def test_twine_check_passes_on_the_sdist_and_the_wheel(dist: Path) -> None:
    files = sorted(str(path) for path in dist.iterdir())
    assert [Path(f).name for f in files] == [f"rlite-{rlite.__version__}-py3-none-any.whl",
                                             f"rlite-{rlite.__version__}.tar.gz"]
    result = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files], capture_output=True,
                            text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_metadata_an_index_shows(wheel: Path, dist: Path) -> None:
    metadata = read_member(wheel, ".dist-info/METADATA")
    assert "License-Expression: Apache-2.0\n" in metadata and "License-File: LICENSE\n" in metadata
    assert "Requires-Python: >=3.10\n" in metadata
    assert "Description-Content-Type: text/markdown\n" in metadata
    classifiers = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Classifier: ")]
    assert "Programming Language :: Python :: 3.10" in classifiers and "Development Status :: 3 - Alpha" in classifiers
    assert {"test", "math", "tensorboard", "wandb", "megatron", "sglang", "liger", "bench"} <= {
        line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Provides-Extra: ")}
    import tarfile

    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"CHANGELOG.md", "LICENSE", "README.md", "pyproject.toml"} <= names


def test_the_docs_name_the_wheel_python_m_build_writes(wheel: Path) -> None:
    """README, docs/gsm8k.md and the GPU recipe's comments install `dist/<wheel>`: the name the build writes."""
    for doc in ("README.md", "docs/gsm8k.md", "configs/qwen2.5_gpu.yaml"):
        named = set(re.findall(r"dist/(rlite-[\w.]+-py3-none-any\.whl)", (ROOT / doc).read_text()))
        assert named == {wheel.name}, f"{doc} names {named}, the build writes {wheel.name}"


def test_the_wheel_installed_in_a_fresh_venv_runs_the_quickstarts_first_steps(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    # the dependencies (torch, transformers, ...) from this venv; the editable rlite of the checkout is not
    # among them: a .pth line adds the folder to sys.path but runs none of its own .pth files
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    result = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                             str(wheel)], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # the user's folder: the quickstart's config and warm start, nothing else of the checkout
    work = tmp_path / "work"
    shutil.copytree(ROOT / "configs", work / "configs", ignore=shutil.ignore_patterns("*.py"))
    shutil.copytree(ROOT / "examples" / "warmstart" / "addition-qwen2-1m", work / "examples" / "warmstart" / "addition-qwen2-1m")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(python), "-c", "import rlite, rlite.plugins.advantages as a; print(rlite.__file__); "
                            "print(a.__file__)"], capture_output=True, text=True, cwd=work, env=env, check=True)  # fmt: skip
    assert all(Path(line).is_relative_to(site) for line in where.stdout.split()), where.stdout
    result = subprocess.run(
        [str(venv / "bin" / "rlite"), "train", "configs/quickstart.yaml", "training.steps=2", "rollout.prompts_per_step=4",
         "rollout.samples_per_prompt=4", "data.num_eval=8", "training.eval_every=2", "checkpoint.every=0",
         "logging.progress_bar=false", "logging.plot=false"],
        capture_output=True, text=True, cwd=work, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (work / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2]
    assert (work / "runs" / "quickstart" / "hf_model" / "config.json").is_file()
    assert "rlite: 2 steps done in" in result.stdout


def test_every_lower_bound_is_the_release_the_floor_probe_tests() -> None:
    """pyproject.toml's ``>=`` bounds (the dependencies and the math extra) are the releases pinned in
    tests/floor/constraints.txt, which tests/floor/run.sh installs; torch's is the one its usage line names."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for line in [*project["dependencies"], *project["optional-dependencies"]["math"]]:
        requirement = Requirement(line)
        (bound,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        floors[requirement.name] = Version(bound)
    text = (ROOT / "tests" / "floor" / "constraints.txt").read_text()
    pinned = {name: Version(version) for name, version in re.findall(r"^([\w.-]+)==(\S+)$", text, re.M)}
    script = (ROOT / "tests" / "floor" / "run.sh").read_text()
    pinned["torch"] = Version(re.search(r"RLITE_FLOOR_TORCH=(\S+) bash tests/floor/run.sh", script)[1])
    assert floors == pinned
