"""SGLang's native DSA ops for real on a CUDA machine where SGLang's native packages are not
installed (test support: the plugin never imports this, and nothing here changes what it does).

Where each comes from:

- FlashMLA (``flash_mla``, the sgl-flash-mla 1.0.0 wheel SGLang 0.5.23 pins): the installed
  package, else ``GPU_FLASH_MLA_DIR`` (a folder holding ``flash_mla/``, or a ``.tar.xz`` of one),
  else ``.whl/flash_mla-1.0.0.tar.xz`` (``bash test/pack_flash_mla.sh``), unpacked once into
  $TMPDIR;
- DeepGEMM (``deep_gemm``): the installed package, else the first of :data:`DEEP_GEMM_VERSIONS`
  whose wheel in ``.whl/real-ops/`` (``bash test/pack_real_ops.sh``) imports and answers the
  schedule call SGLang makes, unpacked once into $TMPDIR and imported with lazy symbol binding, so
  that a torch symbol only an error path calls (missing from this machine's torch) does not stop
  the import; each version is tried in a process of its own first (a library whose load fails can
  abort the process);
- ``sgl_kernel`` (sglang-kernel 0.4.10, SGLang 0.5.23's pin: the norm, rope, quantization and MoE
  ops of a DSA model's server; its Python and SM90 ``common_ops`` without the 1.1 GB ``flash_ops``):
  the installed package, else ``.whl/real-ops/sgl_kernel-0.4.10-sm90.tar.xz``, loaded in a
  process of its own first;
- SGLang's JIT kernels (the top-k v2 plan and transform, the paged-MQA schedule, the fused metadata
  copies): built by SGLang's own ``load_jit`` with nvcc (on PATH, ``CUDA_HOME`` or
  /usr/local/cuda) and ninja (on PATH).

Each raises :class:`Unavailable` with the exact reason (the loader's error, its missing symbol,
the missing tool) where the op cannot run on the machine.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".whl" / "real-ops"
FLASH_MLA_VERSION = "1.0.0"
FLASH_MLA_PACKED = REPO / ".whl" / f"flash_mla-{FLASH_MLA_VERSION}.tar.xz"
# sgl-deep-gemm releases, tried in turn: SGLang 0.5.23's pin first, then older releases with the
# same two paged-MQA functions and signatures.
DEEP_GEMM_VERSIONS = ("0.2.3.post2", "0.2.0", "0.1.5.post3")
# The leaves of the DSA prep that ``dsa_backends.cuda_stand_ins`` can leave SGLang's own on a GPU.
REAL_LEAVES = ("paged-MQA schedule", "top-k v2 plan", "FlashMLA metadata", "JIT metadata copies")


class Unavailable(RuntimeError):
    """A native op that cannot run on this machine; the message says exactly why."""


def unpacked(archive: Path) -> Path:
    """``archive`` (a ``.tar.xz``, or a wheel or zip) unpacked once into $TMPDIR, keyed by content."""
    key = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    stem = archive.name.split(".tar")[0].removesuffix(".whl")
    folder = Path(tempfile.gettempdir()) / f"{stem}-{key}"
    if not folder.is_dir():
        partial = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        if archive.name.endswith(".tar.xz"):
            with tarfile.open(archive, "r:xz") as tar:
                try:
                    tar.extractall(partial, filter="data")
                except TypeError:  # a Python without extraction filters
                    tar.extractall(partial)
        else:
            with zipfile.ZipFile(archive) as wheel:
                wheel.extractall(partial)
        partial.rename(folder)
    return folder


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if exc.__cause__ is not None:
        text += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
    return text


# ------------------------------------------------------------------------------------------------
# FlashMLA
# ------------------------------------------------------------------------------------------------


def _flash_mla_source() -> tuple[Path | None, str]:
    """The folder to put first on sys.path (None: the installed package) and where it came from."""
    given = os.environ.get("GPU_FLASH_MLA_DIR")
    if given:
        path = Path(given)
        if path.is_file():
            return unpacked(path), f"GPU_FLASH_MLA_DIR={given} (unpacked)"
        return path, f"GPU_FLASH_MLA_DIR={given}"
    if importlib.util.find_spec("flash_mla") is not None:
        return None, "the installed package"
    if FLASH_MLA_PACKED.is_file():
        return unpacked(FLASH_MLA_PACKED), f"{FLASH_MLA_PACKED.relative_to(REPO)} (unpacked)"
    return None, "nowhere: not installed, GPU_FLASH_MLA_DIR unset, no .whl/" + FLASH_MLA_PACKED.name


def import_flash_mla():
    """The real ``flash_mla`` with its legacy kernels (SGLang's V3.2 sparse decode and its
    scheduler metadata), and where it came from."""
    folder, where = _flash_mla_source()
    if folder is not None and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        import flash_mla
    except Exception as exc:  # ImportError, or OSError from loading its CUDA extensions
        raise Unavailable(
            f"FlashMLA (sgl-flash-mla {FLASH_MLA_VERSION}, package flash_mla) does not import "
            f"from {where}: {_error(exc)}. Install it, or set GPU_FLASH_MLA_DIR to a folder "
            "holding flash_mla/ or to the .tar.xz of `bash test/pack_flash_mla.sh`"
        ) from exc
    if not flash_mla.has_legacy():
        from flash_mla import _loader

        raise Unavailable(f"FlashMLA's legacy kernels did not load: {_loader._LEGACY_UNAVAILABLE}")
    return flash_mla, where


# ------------------------------------------------------------------------------------------------
# DeepGEMM
# ------------------------------------------------------------------------------------------------

_LAZY_IMPORT = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch  # noqa: F401  (its libraries first: DeepGEMM's _C links them)
sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)
import deep_gemm
# the call SGLang's DSA prep makes: [rows, 1] int32 lengths, 64-token blocks, the SM count
lengths = torch.tensor([[1], [4096]], dtype=torch.int32, device="cuda")
deep_gemm.get_paged_mqa_logits_metadata(lengths, 64, deep_gemm.get_num_sms())
"""


def _deep_gemm_wheel(version: str) -> Path | None:
    found = sorted(glob.glob(str(WHEELS / f"sgl_deep_gemm-{version}-*.whl")))
    return Path(found[0]) if found else None


def deep_gemm_loads() -> dict[str, str | None]:
    """Per version of :data:`DEEP_GEMM_VERSIONS`: None where its wheel imports here (lazily bound,
    in a process of its own) and makes the paged-MQA schedule of two lengths as SGLang calls it,
    else why not (the line naming an undefined symbol, else the last line the process printed)."""
    out = {}
    for version in DEEP_GEMM_VERSIONS:
        wheel = _deep_gemm_wheel(version)
        if wheel is None:
            out[version] = f"no wheel in {WHEELS.relative_to(REPO)}/ (bash test/pack_real_ops.sh)"
            continue
        done = subprocess.run(
            [sys.executable, "-c", _LAZY_IMPORT, str(unpacked(wheel))],
            capture_output=True,
            text=True,
            timeout=300,
        )
        out[version] = None if done.returncode == 0 else _loader_reason(done)
    return out


def _loader_reason(done: subprocess.CompletedProcess) -> str:
    """Why a loader's process failed: the line naming an undefined symbol, else the last line it
    printed, else its exit status."""
    lines = [line.strip() for line in (done.stderr or done.stdout).strip().splitlines()]
    named = [line for line in lines if "undefined symbol" in line] or lines[-1:]
    return named[0] if named else f"exit status {done.returncode}"


def import_deep_gemm():
    """The real ``deep_gemm`` and where it came from: the installed package, else the first
    version of :data:`DEEP_GEMM_VERSIONS` that imports (:func:`deep_gemm_loads`), lazily bound."""
    if importlib.util.find_spec("deep_gemm") is not None:
        import deep_gemm

        return deep_gemm, "the installed package"
    loads = deep_gemm_loads()
    version = next((v for v, why in loads.items() if why is None), None)
    if version is None:
        raise Unavailable(
            "no DeepGEMM imports here: "
            + "; ".join(f"sgl-deep-gemm {v}: {why}" for v, why in loads.items())
        )
    sys.path.insert(0, str(unpacked(_deep_gemm_wheel(version))))
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)
    try:
        import deep_gemm
    finally:
        sys.setdlopenflags(flags)
    skipped = "; ".join(f"{v}: {why}" for v, why in loads.items() if why is not None)
    where = f"sgl-deep-gemm {version} from {WHEELS.relative_to(REPO)}/, lazily bound"
    return deep_gemm, where + (f" (not loading: {skipped})" if skipped else "")


# ------------------------------------------------------------------------------------------------
# sgl_kernel (the norm, rope, quantization and MoE ops a DSA model's server calls)
# ------------------------------------------------------------------------------------------------

SGL_KERNEL_VERSION = "0.4.10"  # SGLang 0.5.23's pin (sglang-kernel)
SGL_KERNEL_PACKED = WHEELS / f"sgl_kernel-{SGL_KERNEL_VERSION}-sm90.tar.xz"
_SGL_KERNEL_CHECK = """
import sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
import torch
import sgl_kernel
torch.manual_seed(0)
x = torch.randn(8, 7168, dtype=torch.bfloat16, device="cuda")
weight = torch.randn(7168, dtype=torch.bfloat16, device="cuda")
got = sgl_kernel.rmsnorm(x, weight, 1e-6).float()
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
print((got - ref).abs().sub(2e-2 * ref.abs()).max().item())
"""


def sgl_kernel_rmsnorm() -> tuple[float, str]:
    """``sgl_kernel`` (its Python and SM90 ``common_ops``: the 1.1 GB ``flash_ops`` cannot travel)
    loaded in a process of its own (a failed op registration aborts the process; and the test's
    own process holds the harness's stub of it, ``sglang_stubs``), which runs its RMSNorm of a
    bf16 batch against float32 RMSNorm: (the largest ``|got - ref| - 0.02 |ref|``, where it came
    from). Else :class:`Unavailable` with the loader's reason (:func:`_loader_reason`; the signal
    where the process was killed)."""
    from support.sglang_stubs import stubbed

    if importlib.util.find_spec("sgl_kernel") is not None and not stubbed("sgl_kernel"):
        folder, where = "", "the installed package"
    elif not SGL_KERNEL_PACKED.is_file():
        raise Unavailable(f"no {SGL_KERNEL_PACKED.relative_to(REPO)} (bash test/pack_real_ops.sh)")
    else:
        folder = str(unpacked(SGL_KERNEL_PACKED))
        where = f"sglang-kernel {SGL_KERNEL_VERSION} from {SGL_KERNEL_PACKED.name}"
    done = subprocess.run(
        [sys.executable, "-c", _SGL_KERNEL_CHECK, folder],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        why = _loader_reason(done)
        if done.returncode < 0:
            why = f"killed by signal {-done.returncode} at import ({why})"
        raise Unavailable(f"sglang-kernel {SGL_KERNEL_VERSION} (SM90 common_ops): {why}")
    return float(done.stdout.split()[-1]), where


# ------------------------------------------------------------------------------------------------
# SGLang's JIT kernels
# ------------------------------------------------------------------------------------------------


def jit_toolchain() -> str:
    """nvcc and ninja on PATH for SGLang's ``load_jit`` (nvcc from ``CUDA_HOME`` or /usr/local/cuda
    where none is on PATH); what they are."""
    if shutil.which("nvcc") is None:
        home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
        if not Path(home, "bin", "nvcc").is_file():
            raise Unavailable(f"SGLang's JIT kernels need nvcc: none on PATH nor in {home}/bin")
        os.environ["PATH"] = f"{home}/bin{os.pathsep}{os.environ['PATH']}"
    if shutil.which("ninja") is None:
        raise Unavailable("SGLang's JIT kernels need ninja: none on PATH (pip install ninja)")
    return f"nvcc {shutil.which('nvcc')}, ninja {shutil.which('ninja')}"


def real_leaves() -> dict[str, str]:
    """Per leaf of :data:`REAL_LEAVES` (what the DSA prep calls that the harness can stand
    in for): where it comes from when it runs for real on the machine (made available: FlashMLA on
    sys.path, nvcc on PATH), else ``"stand-in: "`` and why not (every leaf without a CUDA device).
    """
    import torch

    if not torch.cuda.is_available():
        return {leaf: "stand-in: no CUDA device" for leaf in REAL_LEAVES}
    try:
        jit = f"SGLang's JIT kernel ({jit_toolchain()})"
    except Unavailable as exc:
        jit = f"stand-in: {exc}"
    try:
        _, where = import_flash_mla()
        flash_mla = f"FlashMLA's get_mla_metadata, sgl-flash-mla from {where}"
    except Unavailable as exc:
        flash_mla = f"stand-in: {exc}"
    return {leaf: flash_mla if leaf == "FlashMLA metadata" else jit for leaf in REAL_LEAVES}


def usable_leaves() -> list[str]:
    """The leaves of :func:`real_leaves` that run for real on the machine, each leaf printed with
    where it comes from or why it stays a stand-in."""
    usable = []
    for leaf, where in real_leaves().items():
        print(f"{leaf}: {where}")
        if not where.startswith("stand-in"):
            usable.append(leaf)
    return usable
