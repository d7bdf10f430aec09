"""Fixtures of the hook-site tests: SGLang's DSA backends on the CPU, with the plugin's hooks applied."""

import pytest
import torch


@pytest.fixture
def dsa_server(hooked):
    """``dsa_server(**options)``: a :class:`~support.dsa_backends.CpuDsaServer` on which
    SGLang's plugin loader has applied the plugin's hooks (options: ``num_steps``, ``draft_tokens``,
    ``page_size``, ``kpool``, ``decode_impl``, ``seed``)."""
    from support.dsa_backends import CpuDsaServer

    servers = []

    def build(**options):
        servers.append(CpuDsaServer(hooked, **options))
        return servers[-1]

    yield build
    for server in reversed(servers):
        server.close()


@pytest.fixture
def unapplied(hooked):
    """``unapplied("Class.method")``: SGLang's ``HookRegistry`` counts the hook row whose target
    ends so as not applied (as when it logs and skips a target that fails to apply); returns the
    reason ``hooks.why_off`` then gives for that row's features."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dsa_mtp import hooks

    def leave_out(tail: str) -> str:
        [target] = {row.target for row in hooks.HOOKS if row.target.endswith(f".{tail}")}
        hooked.setattr(HookRegistry, "_patched", HookRegistry._patched - {target})
        return f"SGLang did not apply the plugin's hooks on {target}"

    return leave_out


@pytest.fixture(
    params=[
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="on a CUDA machine the GPU form runs instead"
            ),
        ),
        pytest.param("gpu", marks=pytest.mark.gpu),
    ]
)
def device(request) -> str:
    """A test's two forms: "cpu", its CPU twin (not on a CUDA machine, where the GPU form runs
    instead), and "gpu"."""
    return request.param
