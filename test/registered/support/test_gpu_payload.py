"""The GPU payload: what its two folders hold, and a proof that finds what the tests would miss.

Built from small wheels made here (SGLang's is a stand-in with a few modules), so that the rules are
seen on every file kind: native files, caches and excluded subtrees stay out of ``files/``; a
dependency wheel is laid out as an installer lays it out; the import closure follows imports in
functions and relative imports, and names the module a pruned file is imported by.
"""

import tarfile
import zipfile

import pytest

from support import gpu_payload


def make_wheel(path, members: dict):
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in members.items():
            wheel.writestr(name, text)
    return path


SGLANG_WHEEL = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/a.py": "def f():\n    from .b import g\n",
    "sglang/srt/b.py": "import sglang.srt.c\n",
    "sglang/srt/c.py": "",
    "sglang/srt/native.so": "ELF",
    "sglang/srt/__pycache__/a.cpython-312.pyc": "",
    "sglang/multimodal_gen/__init__.py": "",
    "sglang/kernels/jit/csrc/k.cuh": "// CUDA source",
    "sglang-0.5.23.dist-info/METADATA": "Name: sglang\nVersion: 0.5.23\n",
    "sglang-0.5.23.dist-info/RECORD": "",
}
DEP_WHEEL = {
    "dep/__init__.py": "",
    "dep-1.0.dist-info/METADATA": "Name: dep\n",
    "dep-1.0.data/purelib/dep_extra.py": "",
    "dep-1.0.data/scripts/dep-cli": "#!/bin/sh\n",
}


def staged(tmp_path):
    wheel = make_wheel(tmp_path / "sglang-0.5.23-py3-none-any.whl", SGLANG_WHEEL)
    (tmp_path / "deps").mkdir()
    make_wheel(tmp_path / "deps" / "dep-1.0-py3-none-any.whl", DEP_WHEEL)
    gpu_payload.stage(wheel, tmp_path / "deps", tmp_path / "payload")
    return wheel, tmp_path / "payload"


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_files_hold_sglangs_package_without_native_files_caches_or_excluded_subtrees(tmp_path):
    _, payload = staged(tmp_path)
    assert listing(payload / "files") == [
        "sglang/__init__.py",
        "sglang/kernels/jit/csrc/k.cuh",
        "sglang/srt/__init__.py",
        "sglang/srt/a.py",
        "sglang/srt/b.py",
        "sglang/srt/c.py",
    ]


def test_runtime_holds_sglangs_metadata_and_the_dependencies_as_installed(tmp_path):
    _, payload = staged(tmp_path)
    assert listing(payload / "runtime") == [
        "dep-1.0.dist-info/METADATA",
        "dep/__init__.py",
        "dep_extra.py",
        "sglang-0.5.23.dist-info/METADATA",
    ]


def test_without_dependency_wheels_only_the_files_are_staged(tmp_path):
    wheel = make_wheel(tmp_path / "sglang-0.5.23-py3-none-any.whl", SGLANG_WHEEL)
    gpu_payload.stage(wheel, None, tmp_path / "payload")
    assert not (tmp_path / "payload" / "runtime").exists()
    assert (tmp_path / "payload" / "files" / "sglang" / "srt" / "a.py").is_file()


def test_the_payload_unpacks_to_the_staged_folders(tmp_path):
    _, payload = staged(tmp_path)
    gpu_payload.pack(payload, tmp_path / "payload.tar.xz")
    with tarfile.open(tmp_path / "payload.tar.xz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    for folder in ("files", "runtime"):
        assert listing(tmp_path / "unpacked" / folder) == listing(payload / folder)


def sources_importing(tmp_path, text):
    repo = tmp_path / "repo"
    (repo / "test").mkdir(parents=True)
    (repo / "test" / "test_x.py").write_text(text)
    return repo


@pytest.mark.quick
def test_the_closure_follows_imports_in_functions_and_relative_imports(tmp_path):
    wheel, payload = staged(tmp_path)
    repo = sources_importing(tmp_path, "import sglang.srt.a\n")
    reachable, missing = gpu_payload.check_closure(payload / "files", wheel, repo)
    assert reachable == {"sglang", "sglang.srt", "sglang.srt.a", "sglang.srt.b", "sglang.srt.c"}
    assert missing == []


def test_the_closure_names_a_pruned_module_and_who_imports_it(tmp_path):
    wheel, payload = staged(tmp_path)
    (payload / "files" / "sglang" / "srt" / "c.py").unlink()
    repo = sources_importing(tmp_path, 'HOOK = "sglang.srt.a.f"\n')
    _, missing = gpu_payload.check_closure(payload / "files", wheel, repo)
    assert missing == ["sglang.srt.c (imported by sglang.srt.b)"]


def test_the_closure_counts_files_the_sources_load_by_path(tmp_path):
    wheel, payload = staged(tmp_path)
    (payload / "files" / "sglang" / "srt" / "c.py").unlink()
    repo = sources_importing(tmp_path, 'FILE = "srt/c.py"\n')
    _, missing = gpu_payload.check_closure(payload / "files", wheel, repo)
    assert missing == ["sglang/srt/c.py (loaded by path)"]


def test_the_import_check_loads_sglang_from_the_payload_only(tmp_path):
    _, payload = staged(tmp_path)
    result = gpu_payload.check_imports(
        payload / "files", ["sglang.srt.a", "sglang.srt.nope"], hidden=("jedi",)
    )
    assert list(result["failed"]) == ["sglang.srt.nope"]
    assert result["outside"] == [] and result["imported"] >= 3


def test_the_sources_are_this_checkouts():
    """The default repository is the checkout this module lies in: the tests name SGLang's modules
    (a wrong root finds no source and makes every check pass on nothing)."""
    assert (gpu_payload.REPO / "test" / "support" / "gpu_payload.py").is_file()
    assert all((gpu_payload.REPO / source).is_dir() for source in gpu_payload.SOURCES)
    modules, _ = gpu_payload.named_by_sources()
    assert "sglang.srt.layers.attention.dsa_backend" in modules
