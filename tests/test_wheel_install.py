"""The package as users get it: the wheel, installed (not editable), and the server image's recipe.

Every other test imports the editable tree, so a file the wheel leaves out goes unseen there (the
dashboard's ``static/`` and ``templates/`` once did: ``stepdoctor serve`` from a ``pip install``
crashed). Here the wheel is built from exactly the sources the Dockerfile's build stage copies, with
the README's build command. What it must hold is derived by walking the package folders, so a new
folder that ``[tool.setuptools.package-data]`` misses fails. Installed with the README's command into
a fresh virtual environment (dependencies from this environment, stepdoctor from the wheel only), it
must serve the login, home and trace pages, a static asset and ``/docs``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.server import serve_subprocess, small_trace_bytes, upload

REPO = Path(__file__).resolve().parents[1]
JUNK_DIRS = ("__pycache__",)
JUNK_SUFFIXES = (".pyc", ".pyo", ".egg-info")
INSTALL_TIMEOUT_S = 600
ANALYSIS_TIMEOUT_S = 300.0
# Building, two venvs, installing and serving: minutes on a busy 2-core machine, seconds when idle.
WHEEL_TEST_TIMEOUT_S = 1800


def _pyproject() -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _is_junk(path: Path) -> bool:
    return any(part in JUNK_DIRS or part.endswith(JUNK_SUFFIXES) for part in path.parts)


def top_level_folders() -> dict[str, Path]:
    """Top-level package name -> its folder in the tree, from pyproject's ``package-dir``."""
    folders: dict[str, Path] = {}
    for name, folder in _pyproject()["tool"]["setuptools"]["package-dir"].items():
        if name:
            folders[name] = REPO / folder
        else:  # a root folder: each package folder directly under it
            for sub in sorted((REPO / folder).iterdir()):
                if (sub / "__init__.py").is_file() and not _is_junk(sub.relative_to(REPO)):
                    folders[sub.name] = sub
    return folders


def tree_packages() -> set[str]:
    """Every package of the tree: each folder with an ``__init__.py`` inside a top-level package."""
    found = set()
    for name, folder in top_level_folders().items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if not _is_junk(rel):
                found.add(".".join([name, *rel.parts]))
    return found


def tree_files() -> set[str]:
    """Every file the wheel must hold, as its path in the wheel: all of each package folder."""
    files = set()
    for name, folder in top_level_folders().items():
        for path in folder.rglob("*"):
            rel = path.relative_to(folder)
            if path.is_file() and not _is_junk(rel):
                files.add(f"{name}/{rel.as_posix()}")
    return files


# -- the Dockerfile ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def dockerfile_stages() -> list[list[Instruction]]:
    """The Dockerfile's instructions, one list per stage (a stage starts at FROM)."""
    text = (REPO / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    stages: list[list[Instruction]] = []
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        if not line.strip():
            continue
        keyword, _, args = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        assert stages, "the Dockerfile must start with FROM"
        stages[-1].append(Instruction(keyword.upper(), args.strip()))
    return stages


def _runs(stage: list[Instruction]) -> str:
    return " && ".join(i.args for i in stage if i.keyword == "RUN")


def wheel_stage() -> list[Instruction]:
    """The build stage: the one whose RUN builds the wheel."""
    (stage,) = [s for s in dockerfile_stages() if "pip wheel" in _runs(s)]
    return stage


def copy_build_sources(dest: Path) -> None:
    """Copy what the build stage's COPY lines copy (from the build context, the repo) into ``dest``."""
    for instruction in wheel_stage():
        if instruction.keyword != "COPY":
            continue
        words = [w for w in shlex.split(instruction.args) if not w.startswith("--")]
        *sources, target = words
        for source in sources:
            into = dest / target / Path(source).name if target.endswith("/") else dest / target
            origin = REPO / source
            if origin.is_dir():
                shutil.copytree(
                    origin, into, ignore=shutil.ignore_patterns(*JUNK_DIRS, "*.pyc", "*.egg-info")
                )
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, into)


# -- the README's install commands -------------------------------------------------------------------


def readme_install_commands() -> list[str]:
    """The shell lines of the README's "Install" section's code blocks, comments stripped."""
    readme = (REPO / "README.md").read_text()
    match = re.search(r"^## Install\n(.*?)(?=^## )", readme, re.S | re.M)
    assert match, "the README has no '## Install' section"
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", match.group(1), re.S):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def readme_command(prefix: str, *, containing: str = "") -> str:
    found = [c for c in readme_install_commands() if c.startswith(prefix) and containing in c]
    assert found, f"the README's Install section has no `{prefix} ...{containing}` command"
    return found[0]


# -- building and installing -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from the Dockerfile's build-stage sources with the README's command.

    ``--no-build-isolation`` (pip then builds with this environment's setuptools) is the only flag
    added, so the test needs no network.
    """
    src = tmp_path_factory.mktemp("src")
    copy_build_sources(src)
    command = readme_command("python -m pip wheel")
    argv = [sys.executable, *shlex.split(command)[1:], "--no-build-isolation", "-q"]
    done = subprocess.run(argv, cwd=src, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (src / "dist").glob("stepdoctor-*.whl")
    return wheel


def _clean_env(tmp: Path, venv: Path) -> dict[str, str]:
    """What a user's shell has after activating ``venv``: nothing of this test's environment."""
    return {
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "VIRTUAL_ENV": str(venv),
        "HOME": str(tmp / "home"),
        "LANG": "C.UTF-8",
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
    }


def _dependency_view(tmp: Path) -> Path:
    """This environment's installed packages, minus stepdoctor itself (its editable install).

    A folder of links: put on the new venv's path by a ``.pth`` line, it is a plain path entry, so
    the ``.pth`` hooks of this environment (the editable finder) never run there.
    """
    view = tmp / "site-deps"
    view.mkdir()
    for key in ("purelib", "platlib"):
        for entry in Path(sysconfig.get_paths()[key]).iterdir():
            name = entry.name.lower()
            own = name.startswith(("stepdoctor", "__editable__", "pip-")) or name == "pip"
            if own or name.endswith(".pth"):
                continue
            if not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
    return view


def fresh_venv(tmp: Path, *, dependencies: bool) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=INSTALL_TIMEOUT_S)
    if dependencies:
        site = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.strip()
        (Path(site) / "site_deps.pth").write_text(f"{_dependency_view(tmp)}\n")
    return venv


def readme_install(wheel: Path, tmp: Path, venv: Path, extra: str) -> None:
    """Run the README's wheel install line for ``extra`` as written, in bash, offline (PIP_NO_INDEX)."""
    suffix = f"[{extra}]" if extra else ""
    command = readme_command("pip install", containing=f'.whl){suffix}"')
    (tmp / "dist").mkdir(exist_ok=True)
    shutil.copy2(wheel, tmp / "dist" / wheel.name)
    env = {**_clean_env(tmp, venv), "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(
        ["bash", "-c", command], cwd=tmp, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
    )
    assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"


def _in_venv(
    venv: Path, tmp: Path, *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        cwd=tmp,
        env={**_clean_env(tmp, venv), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


WHERE_FROM = """
import importlib, importlib.metadata, json, sys
mods = {n: importlib.import_module(n).__file__ for n in sys.argv[1].split(",")}
dist = str(importlib.metadata.distribution("stepdoctor").locate_file(""))
print(json.dumps({"modules": mods, "dist": dist, "path": sys.path}))
"""


def assert_stepdoctor_comes_from(venv: Path, tmp: Path) -> None:
    """Every stepdoctor package imports from the venv, and nothing of the source tree is on its path."""
    out = _in_venv(venv, tmp, "python", "-c", WHERE_FROM, ",".join(top_level_folders()))
    assert out.returncode == 0, out.stderr
    where = json.loads(out.stdout)
    site = venv.resolve()
    for module, file in where["modules"].items():
        assert Path(file).resolve().is_relative_to(site), f"{module} imported from {file}, not the venv"
    assert Path(where["dist"]).resolve().is_relative_to(site), where["dist"]
    folders = [folder.resolve() for folder in top_level_folders().values()]
    leaked = [p for p in where["path"] if p and any(Path(p).resolve() in (f, f.parent) for f in folders)]
    assert not leaked, f"the source tree is on the installed package's sys.path: {leaked}"


# -- tests ---------------------------------------------------------------------------------------------


def test_pyproject_lists_every_package_of_the_tree() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert listed == tree_packages(), (
        f"missing from pyproject: {sorted(tree_packages() - listed)}; "
        f"listed but not in the tree: {sorted(listed - tree_packages())}"
    )


def test_every_top_level_package_is_marked_typed() -> None:
    unmarked = [name for name, folder in top_level_folders().items() if not (folder / "py.typed").is_file()]
    assert not unmarked, f"no py.typed (PEP 561) in {unmarked}"


@pytest.mark.slow
@pytest.mark.timeout(WHEEL_TEST_TIMEOUT_S)
def test_the_wheel_holds_every_file_of_the_package_folders(built_wheel: Path) -> None:
    names = zipfile.ZipFile(built_wheel).namelist()
    shipped = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    expected = tree_files()
    assert not expected - shipped, f"left out of the wheel: {sorted(expected - shipped)}"
    assert not shipped - expected, (
        f"in the wheel but not in the package folders: {sorted(shipped - expected)}"
    )
    # What `stepdoctor serve` reads besides modules, and the marker, by kind (each found in the tree).
    for kind in ("templates/", "static/", "versions/", ".mako", "py.typed"):
        assert any(kind in name for name in expected), f"the tree has no {kind} any more: update this test"
    for name in top_level_folders():
        assert f"{name}/py.typed" in shipped
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "stepdoctor = stepdoctor.cli:entry" in zipfile.ZipFile(built_wheel).read(entry_points).decode()


@pytest.mark.slow
@pytest.mark.timeout(WHEEL_TEST_TIMEOUT_S)
def test_the_agent_alone_installs_from_the_wheel(built_wheel: Path, tmp_path: Path) -> None:
    """No dependency at all: the agent imports, and a command of an extra names it in one line."""
    venv = fresh_venv(tmp_path, dependencies=False)
    readme_install(built_wheel, tmp_path, venv, "")
    out = _in_venv(venv, tmp_path, "python", "-c", "import stepdoctor; print(stepdoctor.__file__)")
    assert out.returncode == 0 and Path(out.stdout.strip()).resolve().is_relative_to(venv.resolve()), out
    analyze = _in_venv(venv, tmp_path, "stepdoctor", "analyze", "trace.json.gz")
    assert analyze.returncode == 2, analyze.stderr
    assert "pip install 'stepdoctor[analyze]'" in analyze.stderr and len(analyze.stderr.splitlines()) == 1
    sync = _in_venv(venv, tmp_path, "stepdoctor", "sync", "--help")
    assert sync.returncode == 0, sync.stderr


def _wait_analysed(client: httpx.Client, trace_id: int, token: str) -> dict[str, Any]:
    deadline = time.monotonic() + ANALYSIS_TIMEOUT_S
    while True:
        got = client.get(f"/api/v1/traces/{trace_id}", headers={"Authorization": f"Bearer {token}"})
        assert got.status_code == 200, got.text
        if got.json()["status"] not in ("pending", "running"):
            return dict(got.json())
        assert time.monotonic() < deadline, f"trace {trace_id} not analysed after {ANALYSIS_TIMEOUT_S:.0f} s"
        time.sleep(0.5)


def _local_urls(html: str) -> set[str]:
    return set(re.findall(r"""(?:src|href)=["'](/[^"'#?]+\.(?:js|css|png))["']""", html))


@pytest.fixture
def installed_server(built_wheel: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    venv = fresh_venv(tmp_path, dependencies=True)
    readme_install(built_wheel, tmp_path, venv, "server")
    yield venv, tmp_path


@pytest.mark.slow
@pytest.mark.timeout(WHEEL_TEST_TIMEOUT_S)
def test_the_installed_wheel_serves_the_dashboard(installed_server: tuple[Path, Path]) -> None:
    venv, tmp = installed_server
    assert_stepdoctor_comes_from(venv, tmp)
    data = {"STEPDOCTOR_DATA_DIR": str(tmp / "data")}
    with serve_subprocess(
        data,
        command=[str(venv / "bin" / "stepdoctor")],
        base_env=_clean_env(tmp, venv),
        cwd=tmp,
        timeout_s=240.0,
    ) as server:
        printed = re.search(r"^\s+(sdt_\S+)\s*$", server.output(), re.M)
        assert printed, server.output()
        admin = printed.group(1)
        created = _in_venv(
            venv, tmp, "stepdoctor", "token", "create", "--team", "default", "--scope", "upload", env=data
        )
        assert created.returncode == 0, created.stderr
        upload_token = created.stdout.strip().splitlines()[-1]

        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            sent = upload(client, small_trace_bytes(), token=upload_token, project="wheel", run="installed")
            assert sent.status_code == 201, sent.text
            trace_id = int(sent.json()["id"])
            analysed = _wait_analysed(client, trace_id, admin)
            assert analysed["status"] == "done", analysed

            login = client.get("/login")
            assert login.status_code == 200 and 'name="token"' in login.text, login.text[:2000]
            logged = client.post(
                "/login",
                content=f"token={admin}&next=/",
                headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": server.url},
                follow_redirects=False,
            )
            assert logged.status_code == 303, logged.text[:2000]
            home = client.get("/")
            assert home.status_code == 200 and "wheel" in home.text, home.text[:2000]
            page = client.get(f"/traces/{trace_id}")
            assert page.status_code == 200, page.text[:2000]
            assert "plotly" in page.text

            # Every asset the pages link to, and every file of the tree's static folder (its bytes).
            for url in _local_urls(login.text + home.text + page.text):
                assert client.get(url).status_code == 200, url
            static = top_level_folders()["stepdoctor_dashboard"] / "static"
            for file in sorted(p for p in static.rglob("*") if p.is_file()):
                got = client.get(f"/static/v/any/{file.name}", headers={"Accept-Encoding": "identity"})
                assert got.status_code == 200 and got.content == file.read_bytes(), file.name

            docs = client.get("/docs")
            assert docs.status_code == 200 and "swagger" in docs.text.lower(), docs.text[:2000]
            assert _local_urls(docs.text), docs.text
            for url in _local_urls(docs.text):
                assert client.get(url).status_code == 200, url
            assert client.get("/openapi.json").status_code == 200

    # The analyze extra (inside server) works from the wheel too.
    trace = tmp / "trace.json.gz"
    trace.write_bytes(small_trace_bytes())
    analyzed = _in_venv(venv, tmp, "stepdoctor", "analyze", str(trace), "--format", "json")
    assert analyzed.returncode == 0, analyzed.stderr
    assert json.loads(analyzed.stdout)["schema_version"] >= 1


def test_the_image_installs_the_built_wheel_not_the_source() -> None:
    """The final stage holds no source: it installs the wheel an earlier stage built, not editable."""
    stages = dockerfile_stages()
    assert len(stages) >= 2, "build the wheel in one stage, install it in the next"
    build, final = wheel_stage(), stages[-1]
    assert build is not final
    build_name = build[0].args.split()[-1] if " as " in build[0].args.lower() else None
    assert build_name, "name the build stage (FROM ... AS wheel) so the final stage copies from it"
    copies = [shlex.split(i.args) for i in final if i.keyword in ("COPY", "ADD")]
    assert copies and all(f"--from={build_name}" in words for words in copies), (
        f"the final stage copies only the built wheel, never the source: {copies}"
    )
    installs = _runs(final)
    assert re.search(r"pip install [^&]*\.whl\)?\[server\]", installs), installs
    assert not re.search(r"(^|\s)(-e|--editable)\s", installs) and "pip install ." not in installs
    assert "pip wheel" in _runs(build) and "--no-deps" in _runs(build)


def test_the_server_image_runs_as_a_non_root_user() -> None:
    """The final stage's last USER is a numeric non-root id, set after every RUN, owning the data dir."""
    final = dockerfile_stages()[-1]
    keywords = [i.keyword for i in final]
    assert "USER" in keywords, "the image runs as root"
    last_user = len(keywords) - 1 - keywords[::-1].index("USER")
    assert "RUN" not in keywords[last_user:], "a RUN after USER would need root"
    user = final[last_user].args
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: use a numeric non-root id"
    runs = _runs(final)
    assert f"chown {user}" in runs or f"chown {uid}" in runs, "the data directory must belong to the user"
    env = " ".join(i.args for i in final if i.keyword == "ENV")
    assert "STEPDOCTOR_DATA_DIR=/data" in env and "/data" in runs


def test_the_compose_services_run_what_the_image_installs() -> None:
    """Each service built from the Dockerfile runs a ``stepdoctor`` command of the ``server`` extra
    (what the image installs), keeps its data where the image's user may write, on the exposed port."""
    yaml = pytest.importorskip("yaml")
    from stepdoctor.cli import COMMANDS

    final = dockerfile_stages()[-1]
    image_env = dict(word.split("=", 1) for i in final if i.keyword == "ENV" for word in shlex.split(i.args))
    exposed = {i.args.split("/")[0] for i in final if i.keyword == "EXPOSE"}
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    built = {name: s for name, s in services.items() if s.get("build") in (".", "./")}
    assert {"migrate", "api", "worker"} <= set(built), sorted(built)
    for name, service in built.items():
        program, command, *_ = service["command"]
        assert program == "stepdoctor" and COMMANDS[command].extra == "server", (name, service["command"])
        data_dir = service["environment"].get("STEPDOCTOR_DATA_DIR", image_env["STEPDOCTOR_DATA_DIR"])
        assert data_dir == image_env["STEPDOCTOR_DATA_DIR"], name
    (published,) = built["api"]["ports"]
    assert published.rsplit(":", 1)[1] in exposed
    assert "--port" in built["api"]["command"] and published.rsplit(":", 1)[1] in built["api"]["command"]
