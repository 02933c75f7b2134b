"""`pip install .` (a wheel, not an editable install) ships the embedded default: the demo's tiny target,
drafter, sample data and preset, which dflash.embedded finds in the installed package from any folder.
The demo itself is not run here (minutes on a CPU); the README's `dflash demo` is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from dflash import embedded
from dflash.errors import DflashError

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "dflash", "cli", "configs", "data")

PROBE = """
import json, dflash
from dflash import embedded
from dflash.config import ExtractConfig, build_config
root = embedded.root()
cfg = build_config(ExtractConfig, root / embedded.PRESET, "extract", {"out": "o"})
print(json.dumps({"package": dflash.__file__, "root": str(root), "target": cfg.target, "data": cfg.data,
                  "drafter": str(embedded.path(embedded.TINY_DRAFTER))}))
"""


def _setuptools_is_enough() -> bool:
    """The installed setuptools builds the wheel itself (no isolated build env, nothing downloaded): >= 70.1,
    which has bdist_wheel built in. Else pip builds it as `pip install .` does, with setuptools from the index."""
    try:
        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except Exception:
        return False
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip install .` installs, built from a copy of the sources (a checkout's build/ may hold stale
    files)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    if _setuptools_is_enough():
        cmd.insert(4, "--no-build-isolation")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("dflash-*.whl")
    return built


def test_wheel_holds_the_embedded_default(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in embedded.FILES if f"dflash/_embedded/{f}" not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    assert "dflash/embedded.py" in names and "dflash_cli/demo.py" in names
    assert not any(n.startswith("dflash/_embedded/data/tiny-hybrid-target/") for n in names)  # the demo's only


def test_installed_wheel_resolves_the_embedded_default_from_any_folder(wheel, tmp_path):
    site, elsewhere = tmp_path / "site-packages", tmp_path / "elsewhere"
    zipfile.ZipFile(wheel).extractall(site)  # what pip puts in site-packages
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the checkout's editable finder
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=elsewhere, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    root = site / "dflash" / "_embedded"
    assert Path(found["package"]).parent == site / "dflash"  # the wheel's dflash, not the checkout's
    assert Path(found["root"]) == root
    # The preset's relative paths land in the installed copy: the demo reads nothing from the working folder.
    assert Path(found["target"]) == root / embedded.TINY_TARGET
    assert [Path(d) for d in found["data"]] == [root / "data/sample/generated/text.jsonl",
                                                root / "data/sample/generated/code.jsonl"]
    assert Path(found["drafter"]) == root / embedded.TINY_DRAFTER
    assert not any(elsewhere.iterdir())


def test_checkout_resolves_the_embedded_default():
    """An editable install (or the checkout on PYTHONPATH) reads the repository's data/ and configs/ in place."""
    assert embedded.root() in (REPO, Path(embedded.__file__).resolve().parent / "_embedded")


def test_missing_embedded_default_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded, "ROOTS", (tmp_path / "_embedded", tmp_path))
    with pytest.raises(DflashError, match="embedded tiny target.*not installed"):
        embedded.root()
