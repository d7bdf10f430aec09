"""Fixtures of the hook-site tests: SGLang's DSA backends on the CPU, with the plugin's hooks applied."""

import pytest


@pytest.fixture
def dsa_server(hooked):
    """``dsa_server(**options)``: a :class:`~sglang_dsa_mtp.testing.dsa_backends.CpuDsaServer` on which
    SGLang's plugin loader has applied the plugin's hooks (options: ``num_steps``, ``draft_tokens``,
    ``page_size``, ``kpool``, ``decode_impl``, ``seed``)."""
    from sglang_dsa_mtp.testing.dsa_backends import CpuDsaServer

    servers = []

    def build(**options):
        servers.append(CpuDsaServer(hooked, **options))
        return servers[-1]

    yield build
    for server in reversed(servers):
        server.close()
