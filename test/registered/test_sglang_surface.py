"""The SGLang surface: every SGLang name the plugin hooks, and every private one it reads, lives in
``sglang_surface`` and resolves in SGLang 0.5.23; a name SGLang lacks turns off the features that
need it, naming it; and no module but ``sglang_surface`` touches a private SGLang name."""

import ast
from pathlib import Path

import pytest

from support.sglang_import import require_sglang

require_sglang()

from sglang_dsa_mtp import hooks, plugin, sglang_surface
from sglang_dsa_mtp.sglang_surface import SURFACE, Name
from sglang_dsa_mtp.switches import LIVE_WIDTH, SWITCHES

PACKAGE = Path(sglang_surface.__file__).parent
SURFACE_FILE = Path(sglang_surface.__file__)
# Modules that import only torch and Triton (their private names are those libraries', not SGLang's).
KERNELS = PACKAGE / "kernels"
LIBRARIES = {"torch", "triton", "tl"}
# Dotted SGLang names that are not code the plugin hooks or reads.
NOT_CODE = {"sglang.kernels.jit.utils.arch"}  # a logger, filtered from the command's screen


def product_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_surface_lists_every_private_name_and_every_hook_target():
    """The surface as it stands: the hook targets (through ``hooks``) and the private names read."""
    targets = {row.target for row in hooks.HOOKS}
    declared = {
        value
        for name, value in vars(sglang_surface).items()
        if name.isupper() and isinstance(value, str) and value.startswith("sglang.")
    }
    assert targets <= declared, "a hook target not named in sglang_surface"
    assert {name.path.rpartition(".")[2] for name in SURFACE} == {
        "_patched",
        "_graph_page_table_width",
        "_to_2d_context_lens",
        "_refresh_paged_mqa_schedule_metadata",
        "_refresh_topk_v2_plan",
        "_compute_flashmla_metadata",
        "_jit_fused_metadata_copy_module",
        "_jit_fused_metadata_copy_multi_module",
        "_get_topk_paged",
        "_compute_lm_head",
        "_logits_gatherer",
        "_copy_logits_to_buffer",
        "_can_use_flashinfer_allreduce",
        "_resolve_outplace_all_reduce_method",
        "_pick_config",
        "_is_graph_mode_supported",
        "_early_verify_metadata",
        "_init_replay_attn_metadata",
        "_metadata_glue",
        "_skip_glued_replay_view",
        "_glue_key",
        "_init_replay_attn_metadata_from_view",
        "_states",
    }


@pytest.mark.quick
@pytest.mark.parametrize("name", SURFACE, ids=lambda name: name.path.rpartition(".")[2])
def test_every_private_name_resolves_in_sglang_0_5_23(name):
    assert sglang_surface.resolves(name), name.path


def test_every_hook_target_resolves_in_sglang_0_5_23():
    for row in hooks.HOOKS:
        assert sglang_surface.resolves(Name(row.target, row.switches, "hooked")), row.target


def test_an_instance_attribute_is_probed_by_its_store_in_init():
    processor = "sglang.srt.layers.logits_processor.LogitsProcessor"
    assert sglang_surface.resolves(Name(f"{processor}._logits_gatherer", (), "", instance=True))
    assert not sglang_surface.resolves(Name(f"{processor}._no_such_field", (), "", instance=True))


def test_a_function_is_probed_by_its_keyword_only_parameters():
    prep = sglang_surface.DECODE_RUNNER_VIEW_PREP
    keywords = sglang_surface.VIEW_PREP_KEYWORDS
    assert sglang_surface.resolves(Name(prep, (), "", keywords=keywords))
    assert not sglang_surface.resolves(Name(prep, (), "", keywords=keywords[:-1]))
    assert not sglang_surface.resolves(Name(prep, (), "", keywords=(*keywords, "a_new_one")))
    assert not sglang_surface.resolves(Name(f"{prep}_renamed", (), "", keywords=keywords))


def test_the_glue_hook_names_the_view_preps_keywords():
    from sglang_dsa_mtp.integration.dsa_metadata_glue import glue_replay_view_prep

    keywords = sglang_surface.VIEW_PREP_KEYWORDS
    assert sglang_surface.keyword_only(glue_replay_view_prep) == keywords


def test_a_name_sglang_lacks_turns_off_the_features_that_need_it_naming_it(
    fresh_switches, monkeypatch
):
    lacking = f"{sglang_surface.DSA}._renamed_in_a_later_release"
    for switch in SWITCHES:  # every feature on, the opt-in ones too
        if not switch.default:
            monkeypatch.setenv(switch.env, "1")
    monkeypatch.setattr(
        sglang_surface, "SURFACE", (*SURFACE, Name(lacking, (LIVE_WIDTH,), "a test"))
    )
    planned = plugin._plan()
    assert not planned.status[LIVE_WIDTH.feature].enabled
    assert lacking in planned.status[LIVE_WIDTH.feature].reason
    assert [w for w in planned.warnings if lacking in w] == [
        f"live_width is off, SGLang's own path is used: SGLang lacks {lacking}, which it reads"
    ]
    others = [s for s in SWITCHES if s is not LIVE_WIDTH]
    assert all(planned.status[s.feature].enabled for s in others)


# --- nothing else touches a private SGLang name ---------------------------------------------------


def _our_names(paths) -> set[str]:
    """Every name the plugin itself defines: functions, classes, assigned names and attributes,
    parameters, ``__slots__`` entries, import aliases."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
            if isinstance(node, ast.Assign) and any(
                getattr(target, "id", None) == "__slots__" for target in node.targets
            ):
                names.update(
                    item.value for item in ast.walk(node.value) if isinstance(item, ast.Constant)
                )
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_sglang_uses(path: Path, ours: set[str]) -> list[str]:
    """Where ``path`` names a private name the plugin does not define (an SGLang one), imports a
    private name from SGLang, or spells an SGLang dotted path."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr not in ours and _root(node.value) not in LIBRARIES:
                found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang."):
            found += [f"{where}: import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr",
            "hasattr",
        ):
            attr = node.args[1] if len(node.args) > 1 else None
            if isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                if _private(attr.value) and attr.value not in ours:
                    found.append(f"{where}: {node.func.id}(..., {attr.value!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("sglang.") and " " not in node.value:
                if node.value in NOT_CODE:
                    continue
                found.append(f"{where}: {node.value!r}")
    return found


def test_no_module_but_the_surface_touches_a_private_sglang_name():
    modules = [p for p in product_modules() if p != SURFACE_FILE and KERNELS not in p.parents]
    ours = _our_names(modules)
    found = [use for path in modules for use in private_sglang_uses(path, ours)]
    assert found == [], "private SGLang names outside sglang_surface.py"


def test_the_kernels_import_no_sglang():
    for path in KERNELS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                modules.append(getattr(node, "module", None) or "")
                assert not any(m.split(".")[0] == "sglang" for m in modules), path


def test_the_scan_finds_a_private_sglang_name(tmp_path):
    """The scan can fail: an SGLang private read, import and dotted path are each found."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from sglang.srt.layers.attention.dsa_backend import _to_2d_context_lens\n"
        "def f(backend, metadata):\n"
        "    return backend._graph_page_table_width(metadata)\n"
        "TARGET = 'sglang.srt.layers.logits_processor.LogitsProcessor'\n"
    )
    found = private_sglang_uses(planted, _our_names([planted]))
    assert sorted(use.split(": ", 1)[1] for use in found) == [
        "'sglang.srt.layers.logits_processor.LogitsProcessor'",
        "._graph_page_table_width",
        "import _to_2d_context_lens",
    ]
