"""The environments a newcomer and CI build: the README's commands, the locks, ``tools/env.sh``.

The README's install names the lock ``requirements/dev.txt`` (pip constraints), so that a fresh
machine resolves the set that CI tested, not whatever was released this morning. These tests
keep the locks complete and consistent with ``pyproject.toml``: every requirement of each
environment is pinned in its lock to a version that the requirement admits, so a change of
``pyproject.toml`` that the locks do not follow fails here rather than on a newcomer's machine.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
# What tools/env.sh installs into each environment, as requirements of pyproject.toml.
ENVIRONMENTS = {
    "dev": ["main", "dev"],
    "trl": ["main", "dev", "trl"],
    "verl": ["main", "test", "verl"],
    "nbgrader": ["nbgrader"],
}


def readme_block(marker: str) -> str:
    """The fenced block after ``<!-- ci:MARKER -->`` in README.md, as ``.ci/run`` reads it."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- ci:{marker} -->\n```bash\n(.*?)\n```", text, re.S)
    assert found, f"README.md has no block after <!-- ci:{marker} -->"
    return found.group(1)


def requirements(groups: list[str]) -> list[Requirement]:
    """The requirements of some groups: ``main`` (the dependencies) and extras, expanded."""
    out = []
    for group in groups:
        for line in PYPROJECT["project"]["dependencies"] if group == "main" else EXTRAS[group]:
            req = Requirement(line)
            if canonicalize_name(req.name) == "opd-literate":
                out += requirements(sorted(req.extras))
            else:
                out.append(req)
    return out


def lock(env: str, folder: pathlib.Path = ROOT / "requirements") -> dict[str, Version]:
    """The pins of ``requirements/ENV.txt``, each checked to be a plain ``name==version``."""
    pins = {}
    for line in (folder / f"{env}.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        found = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.!]*)", line)
        assert found, f"requirements/{env}.txt: {line!r} is not a plain name==version pin"
        name = canonicalize_name(found.group(1))
        assert name not in pins, f"requirements/{env}.txt pins {name} twice"
        pins[name] = Version(found.group(2))
    return pins


def test_the_readme_installs_into_a_new_venv_with_the_lock():
    assert readme_block("setup") == "python3 -m venv .venv && . .venv/bin/activate"
    for marker in ("main-command", "test-command"):
        command = readme_block(marker)
        # torch first and exact: the CPU build (a looser requirement pulls a CUDA build)
        assert command.startswith(
            'pip install -c requirements/dev.txt torch==2.13.0 -e ".[dev]" && '), command
    assert readme_block("test-command").endswith("&& python -m pytest")


def test_tools_env_sh_builds_the_environments_listed_here():
    script = (ROOT / "tools/env.sh").read_text()
    listed = re.search(r"case \$env in (\S+)\) ;;", script).group(1).split("|")
    assert listed == list(ENVIRONMENTS)
    assert sorted(p.stem for p in (ROOT / "requirements").glob("*.txt")) == sorted(ENVIRONMENTS)


@pytest.mark.parametrize("env", list(ENVIRONMENTS))
def test_every_requirement_is_locked_to_a_version_it_admits(env):
    pins = lock(env)
    for req in requirements(ENVIRONMENTS[env]):
        name = canonicalize_name(req.name)
        assert name in pins, f"requirements/{env}.txt does not pin {req.name} ({req})"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements/{env}.txt pins {name}=={pins[name]}, which {req} does not admit")
    assert pins["torch"] == Version("2.13.0")  # the CPU build: no local label in a lock
    # the notebooks' check(N) cells run pytest; tools/env.sh installs it beside nbgrader
    assert "pytest" in pins and "numpy" in pins


def test_a_bad_lock_is_caught(tmp_path):
    """A local label, a URL or a doubled pin is refused; a pin outside a range is not admitted."""
    for text in ("torch==2.13.0+cpu\n", "numpy @ file:///wheels/numpy.whl\n",
                 "numpy==2.0.0\nNumPy==2.1.0\n"):
        (tmp_path / "planted.txt").write_text(text)
        with pytest.raises(AssertionError, match="plain name==version|twice"):
            lock("planted", tmp_path)
    assert not Requirement("numpy>=1.24").specifier.contains(Version("1.23.5"))


def test_the_readme_names_the_locked_versions():
    """The README's sentence "The locked tier ran with ..." gives the lock's versions."""
    text = " ".join((ROOT / "README.md").read_text().split())
    sentence = re.search(r"The locked tier ran with (.*?) \(`requirements/dev\.txt` has", text)
    assert sentence, "README.md lost its sentence on the locked versions"
    named = dict(re.findall(r"([A-Za-z][\w-]*) (\d[\w.]*)", sentence.group(1)))
    pins = lock("dev")
    header = (ROOT / "requirements/dev.txt").read_text().splitlines()[1]
    assert f"with Python {named.pop('Python')}," in header
    assert len(named) >= 8
    for name, version in named.items():
        assert pins[canonicalize_name(name)] == Version(version), name
