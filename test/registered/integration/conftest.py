"""Fixtures for the hook-site tests: SGLang's real plugin loader has applied our real hook table.

SGLang is imported inside the fixtures, so that collecting this folder on the GPU machine (which has
SGLang's files but not its dependencies) leaves the skipping to each module's ``importorskip``.
"""

import pkgutil

import pytest


@pytest.fixture
def set_platform(monkeypatch):
    """``set_platform(cuda=..., hip=...)``: what SGLang's and our hook sites see as the platform."""
    import sglang.srt.layers.attention.dsa.dsa_metadata_manager as manager

    from sglang_dsa_mtp.integration import dsa_metadata_selection, dsa_mtp_draft_metadata

    def set_(*, cuda, hip):
        for module in (manager, dsa_metadata_selection, dsa_mtp_draft_metadata):
            monkeypatch.setattr(module, "is_cuda", lambda: cuda)
            monkeypatch.setattr(module, "is_hip", lambda: hip)

    return set_


@pytest.fixture
def hooked(fresh_switches, monkeypatch, set_platform):
    """SGLang's ``load_plugins()`` has run our ``register()`` with the real hook table and applied
    the hooks, on a CUDA platform. Every patched SGLang attribute is restored afterwards."""
    import sglang.srt.plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dsa_mtp import plugin

    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(sglang.srt.plugins, "_plugins_loaded", False)
    monkeypatch.setattr(plugin, "_status", None)
    for row in plugin.HOOKS:  # restore every hooked SGLang attribute after the test
        owner_path, _, attr = row.target.rpartition(".")
        owner = pkgutil.resolve_name(owner_path)
        monkeypatch.setattr(owner, attr, vars(owner)[attr])
    monkeypatch.setenv("SGLANG_PLUGINS", plugin.ENTRY_POINT)
    sglang.srt.plugins.load_plugins()
    set_platform(cuda=True, hip=False)
    return monkeypatch
