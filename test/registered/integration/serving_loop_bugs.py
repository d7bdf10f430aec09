"""The serving loop's acceptance: each deliberate one-line bug below, applied alone to a temporary
copy of the package, must make the serving-loop test (``test_serving_loop.py``) fail. Prints, per
bug, whether the test failed and the first lines of why; exits 1 when a bug the device can see left
the test passing (or could not be applied: the code it patches changed).

    python test/registered/integration/serving_loop_bugs.py  # the CPU twin, the bugs it can see
    source test/gpu_sglang_env.sh && python3 test/registered/integration/serving_loop_bugs.py --gpu

``--bug NAME`` (repeatable) runs only those bugs; ``--all`` runs every bug on the device (the CPU
twin then reports the compile counter's bug as passing: Triton's interpreter compiles nothing).
The results are recorded in docs/testing.md, "What the serving loop catches".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TEST = "test/registered/integration/test_serving_loop.py"
ALL_DEVICES = ("cpu", "gpu")
# The packages a bug may patch (the repository folder, the package's name), copied whole.
PACKAGES = (("python/sglang_dsa_mtp", "sglang_dsa_mtp"), ("test/support", "support"))
# name -> (file in the repository, text, its replacement, the devices whose test sees it)
BUGS = {
    "sglang-as-ours": (
        "python/sglang_dsa_mtp/integration/dsa_metadata_selection.py",
        "Fallback(ours, sglang, what=",
        "Fallback(sglang, sglang, what=",
        ALL_DEVICES,
    ),
    "verify-raises": (
        "python/sglang_dsa_mtp/kernels/ops/attention/dsa_metadata_bounded.py",
        '    """Target-verify replay metadata, bit-identical',
        '    raise RuntimeError("the verify kernel raises at every call")\n'
        '    """Target-verify replay metadata, bit-identical',
        ALL_DEVICES,
    ),
    "compile-counter-disconnected": (
        "test/support/compiles.py",
        "    runtime.jit_post_compile_hook = hook\n",
        "",
        ("gpu",),
    ),
    "dsa-cache-seqlens-not-compared": (
        "test/support/dsa_serving.py",
        '    "dsa_cache_seqlens_int32",\n',
        "",
        ALL_DEVICES,
    ),
    "real-page-table-to-pages": (
        "python/sglang_dsa_mtp/kernels/ops/attention/dsa_metadata_common.py",
        "tl.minimum(tl.cdiv(kv, BLOCK_N) * BLOCK_N, width)",
        "tl.minimum(tl.cdiv(kv, physical_page_size) * physical_page_size, width)",
        ALL_DEVICES,
    ),
    # The engagement counter credits SGLang's kernel, run behind our Fallback, to ours.
    "fallback-launch-counted-as-ours": (
        "test/support/serving_loop.py",
        "self._launched(name, ours=False)",
        "self._launched(name, ours=True)",
        ALL_DEVICES,
    ),
    # The counter's per-call facts (spanning, bindable, bound) credited to a call that launched
    # none of ours (the old counter's ``if planned or bs not in fallback.failed`` -> ``if True``
    # bug, on the line that now asks whether ours launched in the call).
    "fallback-call-credited-to-ours": (
        "test/support/serving_loop.py",
        "        if self._ours[name] > ours:\n",
        "        if True:\n",
        ALL_DEVICES,
    ),
    # The MTP draft decode's glue captured on a private copy of its inputs: every later replay
    # reads the copy's capture-time lengths (an address no replay writes, frozen in the graph).
    "glue-captures-a-frozen-input": (
        "python/sglang_dsa_mtp/integration/dsa_metadata_glue.py",
        "view = SimpleNamespace(**vars(forward_batch), num_padding=0)",
        "view = SimpleNamespace(**{**vars(forward_batch), "
        '"seq_lens": forward_batch.seq_lens.clone()}, num_padding=0)',
        ALL_DEVICES,
    ),
    # The target verify's padded replays left to the eager prep: the glue serves too few replays.
    "glue-skips-padded-replays": (
        "python/sglang_dsa_mtp/integration/dsa_metadata_glue.py",
        "        key = glue.replays.get(bs)\n        if forward_batch.forward_mode is not",
        "        key = glue.replays.get(bs) if raw_bs == bs else None\n"
        "        if forward_batch.forward_mode is not",
        ALL_DEVICES,
    ),
    # The plain-decode role inverted: a server without speculative decoding keeps its eager prep
    # (its glue never captures), and the draft steps' backends are glued as plain decode.
    "glue-plain-decode-role-inverted": (
        "python/sglang_dsa_mtp/integration/dsa_metadata_glue.py",
        'and not getattr(backend, "speculative_num_steps", 0):',
        'and getattr(backend, "speculative_num_steps", 0):',
        ALL_DEVICES,
    ),
    # A DSA backend's glue kept across a recapture: its graphs replay into the old graph state's
    # buffers while the new forward graphs read the new ones.
    "glue-not-reset-on-recapture": (
        "python/sglang_dsa_mtp/integration/dsa_graph_page_tables.py",
        "    reset_glue(backend, BackendState)\n",
        "",
        ALL_DEVICES,
    ),
    # The glue graphs captured each in a pool of its own (SGLang's class alone): memory kept per
    # key that stock frees. Only a GPU's allocator keeps pools.
    "glue-pool-per-key": (
        "python/sglang_dsa_mtp/integration/dsa_metadata_glue.py",
        "        capturing = self._pool is not None and torch.cuda.is_current_stream_capturing()\n",
        "        capturing = False\n",
        ("gpu",),
    ),
    # The launch bound at capture places its inputs in reverse order: its probe differs from
    # Triton's JIT, nothing is bound, and on a GPU the bound launches take none of the replays.
    "bound-inputs-reversed": (
        "python/sglang_dsa_mtp/kernels/ops/launch.py",
        "    return tuple((name, list(arg_names).index(name)) for name in inputs)\n",
        "    return tuple(zip(inputs, sorted((list(arg_names).index(n) for n in inputs), "
        "reverse=True)))\n",
        ("gpu",),
    ),
    # A Fallback op's binding broken: the decode kernel's launch bound at capture is never kept,
    # so that its replays all go through Triton's JIT. Ours launches it only in the MTP victims'
    # draft decodes, glued (in the glue's capture) or eager; only a GPU binds.
    "fallback-decode-never-bound": (
        "python/sglang_dsa_mtp/integration/fallback.py",
        "                if bound is not None:\n",
        '                if bound is not None and binder.what != "decode":\n',
        ("gpu",),
    ),
    "program-stays-on-its-request": (
        "python/sglang_dsa_mtp/kernels/ops/attention/dsa_metadata_common.py",
        "        if tile >= tile_end:\n",
        "        if tile < 0:\n",
        ALL_DEVICES,
    ),
}


def apply(name: str, into: Path) -> None:
    """The plugin and the test support copied into ``into`` with bug ``name`` applied (exactly one
    occurrence)."""
    path, old, new, _ = BUGS[name]
    for folder, package in PACKAGES:
        shutil.copytree(ROOT / folder, into / package)
    folder, package = next((f, p) for f, p in PACKAGES if path.startswith(f"{f}/"))
    target = into / package / Path(path).relative_to(folder)
    text = target.read_text()
    if text.count(old) != 1:
        raise LookupError(f"{path} has {text.count(old)} occurrences of {old!r}, not 1")
    target.write_text(text.replace(old, new))


def run_bug(name: str, gpu: bool) -> tuple[bool, str, float]:
    """(the test failed, why in a few lines, seconds) with bug ``name`` applied."""
    with tempfile.TemporaryDirectory(prefix=f"loop-bug-{name}-") as tmp:
        apply(name, Path(tmp))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, env.get("PYTHONPATH")]))
        # the copies first: the test support by pytest's pythonpath, which names test/ otherwise
        command = [sys.executable, "-m", "pytest", TEST, "-x", "-q", "-p", "no:warnings"]
        command += ["-o", f"pythonpath={tmp}"]
        command += ["-m", "gpu", "-k", "gpu"] if gpu else ["-k", "cpu"]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    lines = (done.stdout + done.stderr).splitlines()
    why = [line for line in lines if line.startswith("E ")][:6] or lines[-3:]
    return done.returncode != 0, "\n".join(why), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="run the GPU test (a CUDA machine)")
    parser.add_argument("--bug", action="append", choices=sorted(BUGS), help="only these bugs")
    parser.add_argument("--all", action="store_true", help="also the bugs the device cannot see")
    args = parser.parse_args(argv)
    device = "gpu" if args.gpu else "cpu"
    names = args.bug or [n for n, bug in BUGS.items() if args.all or device in bug[3]]
    missed = []
    for name in names:
        try:
            failed, why, seconds = run_bug(name, args.gpu)
        except LookupError as exc:
            print(f"{name}: NOT APPLIED ({exc})", flush=True)
            missed.append(name)
            continue
        verdict = "the test FAILED (caught)" if failed else "the test PASSED (missed)"
        print(f"{name}: {verdict} in {seconds:.0f} s\n  " + why.replace("\n", "\n  "), flush=True)
        if not failed and device in BUGS[name][3]:
            missed.append(name)
    print(f"\n{len(names) - len(missed)} of {len(names)} bugs caught on the {device}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
