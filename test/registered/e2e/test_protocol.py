"""The arms, the presets and the interleaved instance order of the end-to-end protocol."""

import sys

import pytest

from support.sglang_import import require_sglang

require_sglang()

from support.e2e.protocol import (  # noqa: E402
    INSTANCE_ORDER,
    PRESETS,
    RUNS_PER_INSTANCE,
    Instance,
    arm_env,
    get_preset,
    parse_server_args,
    server_base_url,
    server_command,
    split_server_args,
)

SWITCH_ENVS = (
    "SGLANG_DSA_BOUNDED_REPLAY_METADATA",
    "SGLANG_SPEC_DRAFT_ARGMAX_EXCHANGE",
    "SGLANG_SPEC_VERIFY_ARGMAX_EXCHANGE",
    "SGLANG_DSA_LIVE_WIDTH",
    "SGLANG_DSA_METADATA_GLUE",
)
# The spec's model flags, which the presets leave to the command line.
SPEC_MODEL_ARGS = [
    "--model-path", "nvidia/GLM-5.2-NVFP4", "--trust-remote-code",
    "--quantization", "modelopt_fp4", "--kv-cache-dtype", "fp8_e4m3",
]  # fmt: skip


@pytest.mark.quick
def test_stock_arm_turns_every_switch_off_whatever_the_environment_says():
    env = arm_env("stock", {"PATH": "/bin", SWITCH_ENVS[0]: "1"})
    assert env == {"PATH": "/bin", **{name: "0" for name in SWITCH_ENVS}}


def test_plugin_arm_leaves_every_switch_at_its_default():
    env = arm_env("plugin", {"PATH": "/bin", **{name: "0" for name in SWITCH_ENVS}})
    assert env == {"PATH": "/bin"}


def test_an_unknown_arm_is_an_error():
    with pytest.raises(ValueError, match="unknown arm 'main'; the arms are stock, plugin"):
        arm_env("main", {})


def test_instances_interleave_stock_plugin_plugin_stock_for_four_runs_per_arm_and_point():
    assert [i.tag for i in INSTANCE_ORDER] == ["stock-1", "plugin-1", "plugin-2", "stock-2"]
    for arm in ("stock", "plugin"):
        assert sum(i.arm == arm for i in INSTANCE_ORDER) * RUNS_PER_INSTANCE == 4


def test_an_instance_tag_names_arm_and_index():
    assert Instance.from_tag("plugin-2") == Instance("plugin", 2)
    for bad in ("main-1", "stock", "stock-x"):
        with pytest.raises(ValueError, match="is not <arm>-<instance>"):
            Instance.from_tag(bad)


def test_tp4_preset_with_the_spec_model_flags_is_the_spec_tp4_server():
    preset = get_preset("tp4-eagle-4-1-5")
    args = parse_server_args([*preset.server_args, *SPEC_MODEL_ARGS])
    assert (args.tp_size, args.speculative_algorithm, args.speculative_eagle_topk) == (
        4,
        "EAGLE",
        1,
    )
    assert (args.speculative_num_steps, args.speculative_num_draft_tokens) == (4, 5)
    assert (args.chunked_prefill_size, args.max_prefill_tokens) == (8192, 8192)
    assert args.mem_fraction_static == 0.83
    assert (args.max_running_requests, args.cuda_graph_max_bs_decode) == (32, 32)
    assert (args.model_path, args.quantization, args.kv_cache_dtype) == (
        "nvidia/GLM-5.2-NVFP4",
        "modelopt_fp4",
        "fp8_e4m3",
    )
    assert preset.concurrencies == (1, 2, 4, 8, 16, 32)


def test_tp8_preset_is_the_spec_tp8_server_without_the_multi_node_flags():
    preset = get_preset("tp8-eagle-5-1-6")
    args = parse_server_args([*preset.server_args, *SPEC_MODEL_ARGS])
    assert (args.tp_size, args.speculative_algorithm, args.speculative_eagle_topk) == (
        8,
        "EAGLE",
        1,
    )
    assert (args.speculative_num_steps, args.speculative_num_draft_tokens) == (5, 6)
    assert (args.chunked_prefill_size, args.max_prefill_tokens) == (8192, 8192)
    assert args.mem_fraction_static == 0.8
    assert (args.max_running_requests, args.cuda_graph_max_bs_decode) == (16, 16)
    assert args.nnodes == 1
    assert preset.concurrencies == (1, 4, 16)


def test_arguments_after_the_preset_override_it():
    preset = get_preset("tp4-eagle-4-1-5")
    args = parse_server_args(
        [*preset.server_args, "--model-path", "m", "--max-running-requests", "8"]
    )
    assert args.max_running_requests == 8


def test_server_arguments_sglang_does_not_accept_are_an_error():
    with pytest.raises(ValueError, match="server arguments: .*--model-path"):
        parse_server_args(["--tp-size", "4"])
    with pytest.raises(ValueError, match="server arguments: unrecognized arguments: --tp-sise"):
        parse_server_args(["--model-path", "m", "--tp-sise", "4"])
    with pytest.raises(ValueError, match="unknown preset 'tp4'"):
        get_preset("tp4")
    assert set(PRESETS) == {"tp4-eagle-4-1-5", "tp8-eagle-5-1-6"}


def test_the_kit_reaches_the_server_where_its_arguments_put_it():
    assert server_base_url(parse_server_args(["--model-path", "m"])) == "http://127.0.0.1:30000"
    wildcard = parse_server_args(["--model-path", "m", "--host", "0.0.0.0", "--port", "31000"])
    assert server_base_url(wildcard) == "http://127.0.0.1:31000"


def test_the_server_is_sglang_launch_server_of_this_python():
    assert server_command(["--model-path", "m"]) == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
    ]


def test_arguments_after_a_double_dash_go_to_the_server():
    assert split_server_args(["--preset", "p", "--", "--model-path", "m"]) == (
        ["--preset", "p"],
        ["--model-path", "m"],
    )
    assert split_server_args(["--preset", "p"]) == (["--preset", "p"], [])
