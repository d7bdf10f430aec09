"""Load SGLang 0.5.23's own code by file path, as the references ours must match.

Importing ``sglang.kernels...`` normally runs ``sglang/__init__.py`` and pulls SGLang's heavy
dependencies, which a CUDA machine running from the wheel's files (``test/gpu_env.sh``) does not
have. These helpers find the installed (or unzipped) ``sglang`` package without importing it and
execute single kernel files under private module names (:func:`load_sglang_file`), or single
functions of a file whose imports cannot run there (:func:`sglang_function`: the function's own
source, compiled against SGLang's file, with the globals the caller names).

On a CPU machine SGLang's wrappers ``assert tensor.is_cuda``; ``strip_asserts=True`` compiles the
file with ``optimize=1`` (as ``python -O`` would), so the same wrapper and kernel run on CPU tensors
under ``TRITON_INTERPRET=1``. Nothing else about the reference changes.
"""

from __future__ import annotations
import __future__

import ast
import importlib.util
import sys
import types
from importlib import metadata
from pathlib import Path

_KPOOL_SCAN = "sglang.kernels.ops.attention.dsa.kpool_metadata.scan"
_KPOOL_SCAN_FILE = "kernels/ops/attention/dsa/kpool_metadata/scan.py"
_cache: dict[tuple[str, bool], types.ModuleType] = {}


def sglang_root() -> Path:
    """Directory of the ``sglang`` package, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "sglang is not installed or on PYTHONPATH; the SGLang 0.5.23 reference kernels are needed"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load_sglang_file(
    relpath: str, *, strip_asserts: bool = False, stand_ins: dict | None = None
) -> types.ModuleType:
    """Execute ``sglang/<relpath>`` as a private module and return it (cached).

    ``stand_ins`` maps module names the file imports to modules served in their place while it
    executes (and only then)."""
    key = (relpath, strip_asserts)
    if key in _cache:
        return _cache[key]
    path = sglang_root() / relpath
    name = "_sglang_reference_{}.{}".format(
        "noassert" if strip_asserts else "plain", relpath[:-3].replace("/", ".")
    )
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    code = compile(path.read_text(), str(path), "exec", optimize=1 if strip_asserts else 0)
    # The KPool kernels import their split helper by absolute name; serve it from a private copy
    # so that the ``sglang`` package itself is never imported here.
    injected = (
        _KPOOL_SCAN not in sys.modules
        and "kpool_metadata/" in relpath
        and relpath != _KPOOL_SCAN_FILE
    )
    if injected:
        sys.modules[_KPOOL_SCAN] = load_sglang_file(_KPOOL_SCAN_FILE)
    served = {name: sys.modules.get(name) for name in stand_ins or {}}
    sys.modules.update(stand_ins or {})
    try:
        exec(code, module.__dict__)
    finally:
        if injected:
            del sys.modules[_KPOOL_SCAN]
        for name, previous in served.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    _cache[key] = module
    return module


def metadata_module(*, strip_asserts: bool = False) -> types.ModuleType:
    """``sglang/kernels/ops/attention/dsa/metadata.py``: the unbounded replay-metadata kernels."""
    return load_sglang_file("kernels/ops/attention/dsa/metadata.py", strip_asserts=strip_asserts)


def kpool_module(op: str, *, strip_asserts: bool = False) -> types.ModuleType:
    """``sglang/kernels/ops/attention/dsa/kpool_metadata/<op>.py`` (decode, verify, draft_extend)."""
    return load_sglang_file(
        f"kernels/ops/attention/dsa/kpool_metadata/{op}.py", strip_asserts=strip_asserts
    )


def topk1_module(*, strip_asserts: bool = False) -> types.ModuleType:
    """``sglang/kernels/ops/speculative/topk1.py``: ``draft_topk1_postprocess``, the greedy draft pick
    on gathered logits (its asserts check shapes and strides only, so it runs on CPU tensors as is).
    """
    return load_sglang_file("kernels/ops/speculative/topk1.py", strip_asserts=strip_asserts)


def softcap_module() -> types.ModuleType:
    """``sglang/kernels/ops/activation/softcap.py``: ``cast_to_float32_logits``, SGLang's cast of
    bf16 logits into its fp32 logits buffer (and the softcapping kernels)."""
    return load_sglang_file("kernels/ops/activation/softcap.py")


def sglang_function(relpath: str, qualname: str, namespace: dict, *, closure: dict | None = None):
    """SGLang's function ``qualname`` (``f``, ``Class.method`` or ``Class.method.inner``) from
    ``sglang/<relpath>``, compiled from its own source (tracebacks show SGLang's file and lines)
    with ``namespace`` as its module globals; nothing else of the file runs.

    A nested function (a closure) needs ``closure``: its free variables by name, bound as the
    enclosing function would bind them. A method comes back as a plain function taking ``self``.
    """
    path = sglang_root() / relpath
    tree = ast.parse(path.read_text(), str(path))
    node, body = None, tree.body
    for name in qualname.split("."):
        node = next(
            (n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name),
            None,
        )
        if node is None:
            raise LookupError(f"{qualname} is not defined in sglang/{relpath}")
        body = node.body
    if not isinstance(node, ast.FunctionDef):
        raise TypeError(f"{qualname} in sglang/{relpath} is not a function")
    if closure is None:
        module = ast.Module(body=[node], type_ignores=[])
    else:  # def _enclosing(<free variables>): <the function>; return <the function>
        module = ast.parse(f"def _enclosing({', '.join(closure)}):\n    return {node.name}")
        module.body[0].body.insert(0, node)
    code = compile(
        ast.fix_missing_locations(module),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    scope = dict(namespace)
    exec(code, scope)
    return scope[node.name] if closure is None else scope["_enclosing"](**closure)


def _platform_stand_ins() -> dict[str, types.ModuleType]:
    """``sglang.srt.utils`` and ``sglang.srt.platforms`` as SGLang's speculative kernel files use
    them, reporting SGLang's Triton platform (its XPU branch): importing the real ones imports all
    of SGLang."""
    import triton

    def module(name, **attrs):
        stand_in = types.ModuleType(name)
        stand_in.__path__ = []  # a package, so that its submodules resolve
        stand_in.__dict__.update(attrs)
        return stand_in

    def reject_out_of_tree_path(platform, subsystem):
        raise RuntimeError(f"{subsystem}: no SGLang platform for it in the reference loader")

    no = lambda: False  # noqa: E731
    platform = types.SimpleNamespace(is_out_of_tree=no)
    return {
        "sglang": module("sglang"),
        "sglang.srt": module("sglang.srt"),
        "sglang.srt.utils": module(
            "sglang.srt.utils",
            is_cpu=no,
            is_cuda=no,
            is_hip=no,
            is_musa=no,
            is_npu=no,
            is_xpu=lambda: True,
            next_power_of_2=triton.next_power_of_2,
        ),
        "sglang.srt.platforms": module("sglang.srt.platforms", current_platform=platform),
        "sglang.srt.platforms.interface": module(
            "sglang.srt.platforms.interface", reject_out_of_tree_path=reject_out_of_tree_path
        ),
    }


def speculative_module(name: str) -> types.ModuleType:
    """``sglang/kernels/ops/speculative/<name>.py`` (``eagle``: the chain-tree kernel, ``spec_tree``:
    the tree builder and greedy verify, ``cache_locs``: the verify cache locations), bound to SGLang's
    Triton implementations (its XPU branch): SGLang's CUDA tree kernels are JIT builds that need
    SGLang's build tools. Where SGLang is not installed (only its files, from the wheel), the
    platform helpers these files import are served by stand-ins."""
    try:
        metadata.version("sglang")
        stand_ins = None
    except metadata.PackageNotFoundError:
        stand_ins = _platform_stand_ins()
    module = load_sglang_file(f"kernels/ops/speculative/{name}.py", stand_ins=stand_ins)
    for flag in ("_is_cuda", "_is_hip", "_is_cpu"):
        if flag in vars(module):
            setattr(module, flag, False)
    if "_is_xpu" in vars(module):
        module._is_xpu = True
    return module
