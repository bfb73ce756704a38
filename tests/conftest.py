"""Shared test setup: offline Hugging Face, one CPU thread per process, plugin-manager fixtures.

Fixtures for plugin tests:

* ``pm``: a fresh plugin manager (built-ins, plus entry-point plugins unless the environment
  disables discovery).
* ``temp_plugin``: ``temp_plugin(obj, name=None, manager=None)`` registers a plugin on ``pm`` (or
  ``manager``) for the duration of the test.
* ``stand_ins``: makes every name the default config selects resolvable even while the built-in
  plugin that owns it is still being written (see ``tests/plugins/rlite_test_stand_ins.py``).
* ``fake_distribution``: writes an installed-looking distribution (``*.dist-info`` with entry
  points) plus its modules into a temp folder, optionally on ``sys.path``.
* ``run_rlite``: runs the ``rlite`` console script in a subprocess.

For backend tests: ``world_of_one``, a single-process gloo world (no port), so FSDP2 parameters become DTensors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

WORKERS_DIR = Path(__file__).resolve().parent / "workers"
# rank_workers.py holds the functions spawned test ranks import by name, fake_sglang.py the SGLang stand-in
# that tests and those ranks import; spawn hands the parent's
# sys.path to the child, so putting the folder here makes it importable on both sides
if str(WORKERS_DIR) not in sys.path:
    sys.path.insert(0, str(WORKERS_DIR))

_HF_HOME = tempfile.mkdtemp(prefix="rlite-tests-hf-home-")
os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    HF_HOME=_HF_HOME,
    TOKENIZERS_PARALLELISM="false",
)

try:
    import torch
except ImportError:  # the config and plugin tests do not need it
    torch = None
else:
    torch.set_num_threads(1)

# kernel-environment guard: a test (or test module import) that leaves ATEN_CPU_CAPABILITY & co. changed fails
from env_guard import _kernel_environment_left_alone, pytest_collection_finish  # noqa: E402, F401

from rlite import plugin_manager  # noqa: E402
from rlite.plugin_manager import RlitePluginManager, build_plugin_manager  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
STAND_INS_DIR = TESTS_DIR / "plugins"
STAND_INS_MODULE = "rlite_test_stand_ins"
PLUGIN_ENV_VARS = ("RLITE_DISABLE_PLUGIN_AUTOLOAD", "RLITE_PLUGINS")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_HF_HOME, ignore_errors=True)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A single-process gloo world (no port): FSDP2 parameters become DTensors. A test file that needs more
    (its own thread count, a compiler reset) defines its own."""
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owns:
        dist.destroy_process_group()


@pytest.fixture
def pm() -> RlitePluginManager:
    """A fresh plugin manager; entry-point discovery follows the environment."""
    return build_plugin_manager()


@pytest.fixture
def temp_plugin(pm: RlitePluginManager) -> Iterator[Callable[..., object]]:
    """Register plugin objects for one test; they are removed afterwards."""
    registered: list[tuple[RlitePluginManager, str]] = []

    def register(
        plugin: object, name: str | None = None, manager: RlitePluginManager | None = None
    ) -> object:
        manager = manager if manager is not None else pm
        plugin_name = manager.register(plugin, name=name)
        assert plugin_name is not None, f"plugin {name!r} is blocked"
        registered.append((manager, plugin_name))
        return plugin

    yield register
    for manager, plugin_name in reversed(registered):
        if manager.has_plugin(plugin_name):
            manager.unregister(name=plugin_name)


@pytest.fixture
def clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entry-point discovery on, unrestricted, whatever the calling shell set."""
    for var in PLUGIN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Add a test-only built-in that registers the default config's names no real built-in has yet."""
    monkeypatch.syspath_prepend(str(STAND_INS_DIR))
    monkeypatch.setattr(
        plugin_manager, "DEFAULT_PLUGINS", [*plugin_manager.DEFAULT_PLUGINS, STAND_INS_MODULE]
    )


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Factory writing an installed distribution that ``importlib.metadata`` finds on ``sys.path``.

    ``make(dist_name, entry_points={"name": "module:attr"}, modules={"module": "source"})`` returns
    the folder to put on ``sys.path``/``PYTHONPATH`` (done in-process unless ``on_sys_path=False``).
    """
    written: list[str] = []

    def make(
        dist_name: str,
        entry_points: dict[str, str],
        modules: dict[str, str],
        version: str = "1.0",
        on_sys_path: bool = True,
    ) -> Path:
        site = tmp_path / f"site-{dist_name}"
        info = site / f"{dist_name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
        lines = ["[rlite]", *(f"{name} = {target}" for name, target in entry_points.items())]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in modules.items():
            (site / f"{module}.py").write_text(source)
        if on_sys_path:
            monkeypatch.syspath_prepend(str(site))
            written.extend(modules)
        return site

    yield make
    for module in written:
        sys.modules.pop(module, None)


@pytest.fixture
def stand_ins_distribution(fake_distribution: Callable[..., Path]) -> Path:
    """The stand-ins as an entry-point plugin in a folder for a subprocess's ``PYTHONPATH``."""
    source = (STAND_INS_DIR / f"{STAND_INS_MODULE}.py").read_text()
    return fake_distribution(
        "rlite-test-stand-ins",
        {"test_stand_ins": STAND_INS_MODULE},
        {STAND_INS_MODULE: source},
        on_sys_path=False,
    )


@pytest.fixture
def run_rlite() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the ``rlite`` console script: ``run_rlite("plugins", "--json", pythonpath=[...])``."""
    script = Path(sys.executable).with_name("rlite")

    def run(
        *args: str, pythonpath: Sequence[Path] = (), env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        command = [str(script)] if script.exists() else [sys.executable, "-m", "rlite"]
        full_env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV_VARS}
        full_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
        full_env.update(env or {})
        return subprocess.run(
            [*command, *args], capture_output=True, text=True, env=full_env, timeout=timeout, check=False
        )

    return run
