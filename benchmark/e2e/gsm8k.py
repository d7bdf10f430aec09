"""The spec's GSM8K accuracy for one preset: stock SGLang against SGLang with the plugin.

    curl -LO https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl
    python benchmark/e2e/gsm8k.py --preset tp4-eagle-4-1-5 --data-path test.jsonl \
        --out results/gsm8k-tp4 -- --model-path nvidia/GLM-5.2-NVFP4 --trust-remote-code \
        --quantization modelopt_fp4 --kv-cache-dtype fp8_e4m3

Everything after ``--`` goes to ``sglang.launch_server`` after the preset's flags. Launches four
servers in turn (stock, plugin, plugin, stock); each answers all questions in file order and in
reverse order, 5-shot, greedy, 512 new tokens. Prints accuracy and accept length per arm and writes
``OUT/report.md``; each run is ``OUT/<arm>-<instance>-<ordering>.json``.

Servers started by hand (``benchmark/e2e/serve.py``): ``--base-url URL --instance TAG`` runs one
instance's share, in the order stock-1, plugin-1, plugin-2, stock-2; then ``--report-only``.
"""

import sys
from pathlib import Path

# test/ on the path: the test support (``support``)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))


from support.e2e import gsm8k
from support.e2e.protocol import (
    Instance,
    check_kit_args,
    get_preset,
    kit_parser,
    parse_server_args,
    split_server_args,
)


def build_parser():
    parser = kit_parser(__doc__)
    parser.add_argument("--data-path", type=Path, help=f"GSM8K test.jsonl ({gsm8k.DATA_URL})")
    parser.add_argument(
        "--parallel", type=int, default=128, help="requests in flight (default: %(default)s)"
    )
    return parser


def main(argv: list[str]) -> None:
    kit_argv, extra = split_server_args(argv)
    parser = build_parser()
    args = parser.parse_args(kit_argv)
    preset = get_preset(args.preset)
    title = f"GSM8K, {preset.description}"
    if args.report_only:
        print(gsm8k.write_report(args.out, title))
        return
    if args.data_path is None:
        parser.error("--data-path is required")
    check_kit_args(parser, args)
    server_args = [*preset.server_args, *extra]
    if args.base_url is None:
        gsm8k.run_accuracy(
            server_args, args.data_path, args.out, args.parallel, args.startup_timeout
        )
        print(gsm8k.write_report(args.out, title))
        return
    parse_server_args(server_args)
    questions = gsm8k.load_questions(args.data_path)
    args.out.mkdir(parents=True, exist_ok=True)
    gsm8k.run_instance(
        args.base_url, Instance.from_tag(args.instance), questions, args.parallel, args.out
    )
    print(f"{args.instance} done; after all four instances: --report-only")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, RuntimeError, TimeoutError) as error:
        sys.exit(f"gsm8k.py: error: {error}")
