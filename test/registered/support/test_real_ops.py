"""Which of SGLang's native leaves the GPU harness runs for real (``support.real_ops``): decided per
leaf, each with where it comes from or why it stays a stand-in."""

import tarfile

import pytest
import torch

from support import real_ops


@pytest.mark.quick
@pytest.mark.skipif(torch.cuda.is_available(), reason="off a GPU only")
def test_off_a_gpu_every_leaf_is_a_stand_in_and_none_is_used(capsys):
    leaves = real_ops.real_leaves()
    assert set(leaves) == set(real_ops.REAL_LEAVES)
    assert set(leaves.values()) == {"stand-in: no CUDA device"}
    assert real_ops.usable_leaves() == []
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{leaf}: stand-in: no CUDA device" for leaf in leaves]


@pytest.mark.quick
def test_with_a_gpu_a_leaf_is_used_only_where_it_loads(monkeypatch, capsys):
    """The JIT leaves follow the toolchain, FlashMLA's metadata its import; each told."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(real_ops, "jit_toolchain", lambda: "nvcc N, ninja J")

    def no_flash_mla():
        raise real_ops.Unavailable("no flash_mla")

    monkeypatch.setattr(real_ops, "import_flash_mla", no_flash_mla)
    jit = ["paged-MQA schedule", "top-k v2 plan", "JIT metadata copies"]
    assert real_ops.usable_leaves() == jit
    assert "FlashMLA metadata: stand-in: no flash_mla" in capsys.readouterr().out

    def no_nvcc():
        raise real_ops.Unavailable("no nvcc")

    monkeypatch.setattr(real_ops, "jit_toolchain", no_nvcc)
    monkeypatch.setattr(real_ops, "import_flash_mla", lambda: (None, "a folder"))
    assert real_ops.usable_leaves() == ["FlashMLA metadata"]


@pytest.mark.quick
def test_sgl_kernel_without_its_package_is_unavailable_naming_the_packing_script(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(real_ops.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(real_ops, "SGL_KERNEL_PACKED", tmp_path / "absent.tar.xz")
    monkeypatch.setattr(real_ops, "REPO", tmp_path)
    with pytest.raises(real_ops.Unavailable, match="pack_real_ops.sh"):
        real_ops.sgl_kernel_rmsnorm()


def _packed(tmp_path, init: str):
    """A packed ``sgl_kernel`` whose ``__init__`` is ``init``."""
    folder = tmp_path / "src" / "sgl_kernel"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(init)
    archive = tmp_path / "sgl_kernel.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(folder, arcname="sgl_kernel")
    return archive


@pytest.mark.quick
@pytest.mark.parametrize(
    "init, named",
    [
        (
            'raise ImportError("common_ops.abi3.so: undefined symbol: _ZN5torch7Library4_defE")',
            "undefined symbol: _ZN5torch7Library4_defE",
        ),
        ("import os\nos.abort()", "killed by signal 6 at import"),
    ],
    ids=["undefined symbol", "aborted"],
)
def test_sgl_kernel_that_does_not_load_is_unavailable_with_the_loaders_reason(
    monkeypatch, tmp_path, init, named
):
    """Loaded in a process of its own: the line naming an undefined symbol, or the signal that
    killed the process, makes the reason; nothing is imported into the test's process."""
    monkeypatch.setattr(real_ops.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(real_ops, "SGL_KERNEL_PACKED", _packed(tmp_path, init))
    monkeypatch.setattr(real_ops.tempfile, "gettempdir", lambda: str(tmp_path))
    with pytest.raises(real_ops.Unavailable, match=named):
        real_ops.sgl_kernel_rmsnorm()


def test_the_harness_stub_of_sgl_kernel_is_not_taken_for_the_installed_package(
    monkeypatch, tmp_path
):
    """In a process whose ``sgl_kernel`` is the harness's stand-in (``sglang_stubs``) the probe
    looks for the packed one, as where none is installed."""
    from support import sglang_stubs

    monkeypatch.setattr(real_ops.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(sglang_stubs, "stubbed", lambda package: package == "sgl_kernel")
    monkeypatch.setattr(real_ops, "SGL_KERNEL_PACKED", tmp_path / "absent.tar.xz")
    monkeypatch.setattr(real_ops, "REPO", tmp_path)
    with pytest.raises(real_ops.Unavailable, match="pack_real_ops.sh"):
        real_ops.sgl_kernel_rmsnorm()
