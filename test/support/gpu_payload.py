"""SGLang 0.5.23 for a CUDA machine that has torch and triton but neither SGLang nor a network.

The GPU runner (``test/run_gpu.sh``) needs SGLang's files for the kernel tests (SGLang's Triton
kernels, loaded by path) and SGLang's runtime for the tests that import it. Both come from one
payload, ``.whl/sglang-0.5.23-gpu.tar.xz`` (``test/pack_gpu_payload.sh`` builds it), small enough
to travel beside the checkout and a Triton of its own. Its two folders:

- ``files/``: the ``sglang`` package of SGLang's wheel, without native files (``*.so``), compiled
  caches and the subtrees of :data:`EXCLUDED` (nothing the tests import reaches them, whatever
  branch SGLang's code takes: :func:`check_closure`). ``test/gpu_env.sh`` puts it on
  ``PYTHONPATH`` (no distribution metadata: the modules that need SGLang's runtime skip).
- ``runtime/``: SGLang's distribution metadata (without its file list) and the wheels of
  ``test/gpu_sglang_deps.txt`` unpacked as an installer lays them out; ``test/gpu_sglang_env.sh``
  adds it, and SGLang imports (its native packages stubbed: ``sglang_stubs``).

Commands (``python -m support.gpu_payload``): ``stage WHEEL DEPS DEST`` lays both
folders out in DEST (the env scripts do it from the wheels in ``.whl/`` when there is no payload);
``pack DEST OUT`` writes the payload; ``check DEST WHEEL`` proves that ``files/`` holds every
SGLang module the tests import (:func:`check_closure`, then :func:`check_imports` in a fresh
interpreter with any installed SGLang hidden); ``sizes FILE...`` prints what travels.

Standard library only: a CUDA machine runs ``stage`` before anything else is on the path.
"""

from __future__ import annotations

import argparse
import ast
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

SGLANG = "sglang-0.5.23"
PAYLOAD = f"{SGLANG}-gpu.tar.xz"
# Subtrees of the sglang package left out: the diffusion server (multimodal_gen, 20 MB), which no
# module reachable from the tests' imports names (check_closure proves it for every build).
EXCLUDED = ("sglang/multimodal_gen/",)
TRANSFER_LIMIT = 64 * 2**20  # what travels to a lent CUDA machine with one command, in bytes
REPO = Path(__file__).resolve().parents[2]  # test/support/ -> the checkout
# Where the tests, the test support and the benchmarks name SGLang's modules.
SOURCES = ("python/sglang_dsa_mtp", "test", "benchmark")
_DOTTED = re.compile(r"sglang(\.\w+)+")


def _kept(name: str) -> bool:
    """Whether the wheel member ``name`` belongs in ``files/``."""
    if not name.startswith("sglang/") or name.endswith((".so", ".pyc")):
        return False
    return "/__pycache__/" not in name and not name.startswith(EXCLUDED)


def stage(wheel: Path, deps: Path | None, dest: Path) -> None:
    """Lay out ``dest/files`` from SGLang's ``wheel`` and, with the dependency wheels in ``deps``,
    ``dest/runtime`` (SGLang's metadata, each dependency unpacked as an installer does: its
    ``.data/purelib`` and ``.data/platlib`` at the top, its scripts and data files left out)."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(dest / "files", [n for n in names if _kept(n)])
        if deps is None:
            return
        wheels = sorted(deps.glob("*.whl"))
        if not wheels:
            raise FileNotFoundError(
                f"no wheels in {deps}: fetch them as test/gpu_sglang_deps.txt says"
            )
        info = f"{SGLANG}.dist-info/"
        runtime = dest / "runtime"
        archive.extractall(
            runtime, [n for n in names if n.startswith(info) and n != info + "RECORD"]
        )
    for dep in wheels:
        with zipfile.ZipFile(dep) as archive:
            for member in archive.infolist():
                target = _installed_path(member.filename)
                if target is None or member.is_dir():
                    continue
                path = runtime / target
                path.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, open(path, "wb") as out:
                    shutil.copyfileobj(src, out)
                if member.external_attr >> 16 & 0o111:
                    path.chmod(0o755)


def _installed_path(name: str) -> str | None:
    top, _, rest = name.partition("/")
    if not top.endswith(".data"):
        return name
    kind, _, rest = rest.partition("/")
    return rest if kind in ("purelib", "platlib") and rest else None


def pack(dest: Path, out: Path) -> None:
    """Write ``dest``'s two folders to the xz tarball ``out`` (preset 9, extreme)."""
    partial = out.with_name(out.name + ".partial")
    with lzma.open(partial, "wb", preset=9 | lzma.PRESET_EXTREME) as xz:
        with tarfile.open(fileobj=xz, mode="w") as tar:
            for folder in ("files", "runtime"):
                tar.add(dest / folder, arcname=folder)
    partial.replace(out)


# --- the proof: every SGLang module the tests import is in files/ ----------------------------------


def named_by_sources(repo: Path = REPO) -> tuple[set[str], set[str]]:
    """``(dotted, relpaths)``: every ``sglang...`` name the tests, the test support and the
    benchmarks import or spell as a string (hook targets, ``"sglang.x.y:attr"``), and every
    ``"<dir>/<file>.py"`` string constant (SGLang's files loaded by path, relative to ``sglang/``).
    """
    dotted, relpaths = set(), set()
    for source in SOURCES:
        for path in sorted((repo / source).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    dotted.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    dotted.add(node.module)
                    dotted.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value.split(":")[0]
                    if _DOTTED.fullmatch(text):
                        dotted.add(text)
                    elif re.fullmatch(r"[\w/]+/\w+\.py", node.value):
                        relpaths.add(node.value)
    return {n for n in dotted if n == "sglang" or n.startswith("sglang.")}, relpaths


class Tree:
    """The modules of a tree of ``sglang/`` files: ``names`` (paths relative to the tree's root)."""

    def __init__(self, names):
        self.names = set(names)

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        for candidate in (base + "/__init__.py", base + ".py"):
            if candidate in self.names:
                return candidate
        return None


def _imports_of(source: str, dotted: str, is_package: bool) -> set[str]:
    """Every ``sglang`` name an import statement of ``source`` names, at any depth (functions,
    branches, ``try`` blocks), relative imports resolved against ``dotted``."""
    package = dotted if is_package else dotted.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return {n for n in names if n == "sglang" or n.startswith("sglang.")}


def check_closure(files: Path, wheel: Path, repo: Path = REPO) -> tuple[set[str], list[str]]:
    """``(reachable, missing)``: the SGLang modules reachable from what the sources name, following
    every import statement of every reachable module (whatever branch would run it), and those of
    them that the wheel has and ``files/`` lacks, each with the module that imports it. Files the
    sources load by path count too."""
    with zipfile.ZipFile(wheel) as archive:
        full = Tree(n for n in archive.namelist() if n.startswith("sglang/"))
    kept = Tree(str(p.relative_to(files)) for p in files.rglob("*") if p.is_file())
    dotted, relpaths = named_by_sources(repo)
    missing = [
        f"sglang/{rel} (loaded by path)"
        for rel in sorted(relpaths)
        if f"sglang/{rel}" in full.names and f"sglang/{rel}" not in kept.names
    ]
    reachable, todo = set(), [(name, "the tests") for name in sorted(dotted)]
    while todo:
        name, importer = todo.pop()
        if name in reachable:
            continue
        path = full.module_file(name)
        if path is None:  # an attribute (``from m import f``, a hook target): its owner counts
            if "." in name:
                todo.append((name.rpartition(".")[0], importer))
            continue
        reachable.add(name)
        if kept.module_file(name) is None:
            missing.append(f"{name} (imported by {importer})")
            continue
        parts = name.split(".")
        todo.extend((".".join(parts[:i]), name) for i in range(1, len(parts)))
        source = (files / path).read_text()
        todo.extend((n, name) for n in _imports_of(source, name, path.endswith("__init__.py")))
    return reachable, sorted(missing)


_IMPORTER = r"""
import importlib, json, sys
files, modules = sys.argv[1], json.loads(sys.argv[2])
for hidden in json.loads(sys.argv[3]):
    sys.modules[hidden] = None
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
outside = sorted(
    name for name, module in sys.modules.items()
    if name.split(".")[0] == "sglang" and module is not None
    and getattr(module, "__file__", None) and not module.__file__.startswith(files)
)
print(json.dumps(dict(failed=failed, outside=outside,
                      imported=sum(1 for n in sys.modules if n.split(".")[0] == "sglang"))))
"""


def check_imports(files: Path, modules, hidden=(), repo: Path = REPO) -> dict:
    """Import ``modules`` in a fresh interpreter whose path starts with ``files``, this checkout's
    ``python/`` and ``test/`` (so an installed SGLang is shadowed), with the packages ``hidden`` made unimportable.
    Returns ``failed`` (module: error), ``outside`` (SGLang modules loaded from anywhere but
    ``files``) and the count of SGLang modules ``imported``."""
    paths = [str(files), str(repo / "python"), str(repo / "test")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    files_prefix = str(files.resolve()) + os.sep
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _IMPORTER,
            files_prefix,
            json.dumps(sorted(modules)),
            json.dumps(sorted(hidden)),
        ],
        env=env,
        cwd=files,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the import check did not run:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def check(dest: Path, wheel: Path) -> bool:
    """Print and return whether ``dest/files`` holds every SGLang module the tests import."""
    files = (dest / "files").resolve()
    reachable, missing = check_closure(files, wheel)
    print(
        f"closure: {len(reachable)} SGLang modules reachable from the tests' imports, "
        f"{len(missing)} missing from the payload"
    )
    for line in missing:
        print(f"  missing: {line}")
    dotted, _ = named_by_sources()
    tree = Tree(str(p.relative_to(files)) for p in files.rglob("*.py"))
    modules = sorted({_owner(tree, name) for name in dotted} - {None})
    # Packages that test/gpu_sglang_deps.txt leaves out (IPython imports jedi only to complete).
    result = check_imports(files, modules, hidden=("jedi", "parso"))
    print(
        f"import: {len(modules)} modules the tests name, imported from {files} with any "
        f"installed SGLang hidden: {len(result['failed'])} failed, "
        f"{result['imported']} SGLang modules loaded, {len(result['outside'])} from elsewhere"
    )
    for name, error in result["failed"].items():
        print(f"  failed: {name}: {error}")
    for name in result["outside"]:
        print(f"  from elsewhere: {name}")
    return not (missing or result["failed"] or result["outside"])


def _owner(tree: Tree, dotted: str) -> str | None:
    """The longest prefix of ``dotted`` that is a module of ``tree`` (a name's own module)."""
    while dotted and tree.module_file(dotted) is None:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


# --- what travels -----------------------------------------------------------------------------------


def checkout_bytes(repo: Path = REPO) -> int:
    """The bytes of this checkout that travel: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        (repo / os.fsdecode(n)).stat().st_size
        for n in listed
        if n and (repo / os.fsdecode(n)).is_file()
    )


def sizes(paths) -> int:
    """Print the size of each of ``paths``, of the checkout and of all of them against the transfer
    limit; returns the total."""
    rows = [(str(p), Path(p).stat().st_size) for p in paths]
    rows.append(("the checkout (tracked and untracked, not ignored)", checkout_bytes()))
    total = sum(size for _, size in rows)
    for name, size in rows:
        print(f"{size / 1e6:8.1f} MB  {name}")
    print(
        f"{total / 1e6:8.1f} MB  in all, of {TRANSFER_LIMIT / 1e6:.1f} MB (64 MiB): "
        f"{(TRANSFER_LIMIT - total) / 1e6:.1f} MB to spare"
    )
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m support.gpu_payload", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("stage", help="lay out files/ and runtime/ from the wheels")
    cmd.add_argument("wheel", type=Path, help="SGLang's wheel")
    cmd.add_argument("deps", help="the folder of dependency wheels, or - for files/ only")
    cmd.add_argument("dest", type=Path, help="an empty or new folder")
    cmd = commands.add_parser("pack", help="write the payload from a staged folder")
    cmd.add_argument("dest", type=Path)
    cmd.add_argument("out", type=Path)
    cmd = commands.add_parser("check", help="prove that files/ holds what the tests import")
    cmd.add_argument("dest", type=Path)
    cmd.add_argument("wheel", type=Path)
    cmd = commands.add_parser("sizes", help="what travels, against the 64 MiB limit")
    cmd.add_argument("paths", nargs="*", type=Path)
    args = parser.parse_args(argv)
    if args.command == "stage":
        stage(args.wheel, None if args.deps == "-" else Path(args.deps), args.dest)
    elif args.command == "pack":
        pack(args.dest, args.out)
    elif args.command == "check":
        return 0 if check(args.dest, args.wheel) else 1
    else:
        return 0 if sizes(args.paths) <= TRANSFER_LIMIT else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
