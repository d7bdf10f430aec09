"""The sizes and sentinels the test support, the tests and the benchmarks share, each defined once."""

from sglang_dsa_mtp.devices import H200_SMS

CONTEXT_1M = 1 << 20  # SGLang's default --context-length on GLM-5 and DeepSeek-V3.2
WIDTH_1M = 1_048_640  # req_to_token's width at that context: cdiv(width, 128) = 8193 column blocks
SMALL_WIDTH = 300  # the CPU tables' width: a multiple of neither 64 nor 128
POISON = -0x2B2B2B2B  # what every output buffer holds before a kernel runs
SMS = H200_SMS  # the SM count of the stand-ins for DeepGEMM's schedule and the indexer
