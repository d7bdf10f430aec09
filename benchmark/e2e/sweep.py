"""The spec's end-to-end speed table for one preset: stock SGLang against SGLang with the plugin.

    python benchmark/e2e/sweep.py --preset tp4-eagle-4-1-5 \
        --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --out results/sweep-tp4 \
        -- --model-path nvidia/GLM-5.2-NVFP4 --trust-remote-code \
        --quantization modelopt_fp4 --kv-cache-dtype fp8_e4m3

Everything after ``--`` goes to ``sglang.launch_server`` after the preset's flags (the last
occurrence of a flag wins, ``--host``/``--port`` included). Launches four servers in turn (stock,
plugin, plugin, stock); each is warmed up and runs every concurrency point twice with
``python -m sglang.benchmark.serving``. Prints the table and writes ``OUT/report.md`` and
``OUT/tok_s_user.png``; the raw results are ``OUT/<arm>-<instance>.jsonl``, the server logs
``OUT/<arm>-<instance>.server.log``.

Servers started by hand (several nodes: start each one with ``benchmark/e2e/serve.py``): run each
instance's share with ``--base-url URL --instance TAG`` and the same preset and ``--`` arguments, in
the order stock-1, plugin-1, plugin-2, stock-2; then ``--report-only`` prints the table.
"""

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))


from support.e2e import sweep
from support.e2e.protocol import (
    Instance,
    check_kit_args,
    get_preset,
    kit_parser,
    split_server_args,
)


def build_parser():
    parser = kit_parser(__doc__)
    parser.add_argument(
        "--dataset-path", type=Path, help="ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", help="concurrency points (default: the preset's)"
    )
    return parser


def main(argv: list[str]) -> None:
    kit_argv, extra = split_server_args(argv)
    parser = build_parser()
    args = parser.parse_args(kit_argv)
    preset = get_preset(args.preset)
    title = f"Concurrency sweep, {preset.description}"
    if args.report_only:
        print(sweep.write_report(args.out, title))
        return
    if args.dataset_path is None:
        parser.error("--dataset-path is required")
    check_kit_args(parser, args)
    server_args = [*preset.server_args, *extra]
    concurrencies = args.concurrency or preset.concurrencies
    if args.base_url is None:
        sweep.run_sweep(
            server_args, concurrencies, args.dataset_path, args.out, args.startup_timeout
        )
        print(sweep.write_report(args.out, title))
        print(f"plot: {args.out / 'tok_s_user.png'}")
        return
    parsed = sweep.check_setup(server_args, concurrencies, args.dataset_path)
    args.out.mkdir(parents=True, exist_ok=True)
    sweep.run_instance(
        args.base_url,
        Instance.from_tag(args.instance),
        concurrencies,
        parsed.max_running_requests,
        args.dataset_path,
        args.out,
    )
    print(f"{args.instance} done; after all four instances: --report-only")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, RuntimeError, TimeoutError) as error:
        sys.exit(f"sweep.py: error: {error}")
