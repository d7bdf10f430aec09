"""Test and benchmark support: what the tests and benchmarks share, kept out of the installed package.

Imported as ``support``: pytest puts ``test/`` on the path (``pythonpath`` in ``pyproject.toml``), a
benchmark script puts it there itself, and ``test/gpu_env.sh`` for the GPU runner. The plugin
(``python/sglang_dsa_mtp``) never imports it. What is here:

- ``reference``: SGLang 0.5.23's own pure-Triton kernels, loaded by file path (the references),
  SGLang's speculative kernels with stand-ins for the platform helpers they import;
- ``metadata_cases``: replay-metadata scenarios with poisoned buffers;
- ``differential``: seeded random replay-metadata cases and their budgets, for the GPU
  differential tests against SGLang's kernels;
- ``argmax_cases``: greedy-draft argmax scenarios (tie / NaN / inf rows);
- ``dsa_backends``: SGLang's real DSA backends built by its own constructors in a published EAGLE
  launch, off the GPU (CPU or meta device), with stand-ins for its native and JIT leaves, their
  graph captures and replays; ``CpuDsaServer`` for the replay-metadata hook sites;
- ``dsa_serving``: one EAGLE server's DSA backends on a GPU or the CPU, built by SGLang's
  constructors, captured and replayed as its graph runners do, the plugin on and off side by side;
- ``serving_loop``: EAGLE rounds replayed through them, every metadata buffer compared, failures
  injected, Triton's compiles counted;
- ``dsa_layer``: one DSA attention layer (SGLang's indexer top-k and sparse MLA decode over a real
  KV pool) in those graphs, its outputs compared between the arms;
- ``indexer_cases``: the DSA indexer's chunked paged-MQA logits, SGLang's and the live-width copy;
- ``real_ops``: SGLang's native DSA ops for real on a CUDA machine without its native packages
  (FlashMLA and DeepGEMM from their wheels, SGLang's JIT kernels built there), or why not;
- ``verify_rounds``: one EAGLE verify round through SGLang's own verify code (its batches,
  sampling info, verify input and ``eagle_sample``), for the target-verify argmax exchange;
- ``verify_tree``: a chain draft's verify inputs, built SGLang's FULL_MASK way and its chain-tree way;
- ``tp``: tensor-parallel groups of processes: spawning them, SGLang's real TP group on CPU (gloo)
  and on GPU (one all-reduce route at a time), a raw NCCL group and its all-reduce arms, the
  all-reduce route recorder and capture replayer, and the TP benchmarks' helpers;
- ``tp_routes``: what the argmax exchanges' route tests and route benchmarks share, in SGLang's TP
  group one all-reduce route at a time: each rank's body around an exchange's own checks or arms,
  the hard rows over a rank's LM-head logits, the verdict on the ranks' reports, the benchmarks'
  options, timed arms and tables;
- ``deployment``: the target and MTP draft LM heads built as SGLang builds them for a (quantized)
  checkpoint, and their logits path (forward, SGLang's greedy pick, the per-shard reference);
- ``verify_logits_memory``: the target model's LM head and LogitsProcessor captured as SGLang's
  target-verify runner captures them (one shared pool, its shared logits buffer), exchange off, on
  and a per-graph-shard control: the memory each keeps after capture;
- ``launch_stubs``: stand-in compiled kernels, so that the replay-metadata wrappers' launches are
  bound on the CPU as on a GPU (the kernel tests and the host-time profile);
- ``compiles``: counting Triton JIT compiles (the no-compile-on-the-serving-path GPU tests);
- ``timing``: CUDA-graph and host timing, and the floors printed beside every figure;
- ``scripts``: loading a benchmark or e2e script as a module, its options and their help;
- ``bench_cli``: the benchmark scripts' shared options and output;
- ``e2e``: the end-to-end kit (stock SGLang against SGLang with the plugin) behind the scripts of
  ``benchmark/e2e/``;
- ``constants``: the sizes and sentinels the tests and benchmarks share;
- ``sglang_import``: ``require_sglang()``, which test modules that need SGLang start with, and
  the list of those modules (the GPU runner runs them in SGLang's environment);
- ``sglang_stubs``: stand-ins for SGLang's native packages where they are absent (a pytest plugin);
- ``gpu_payload``: SGLang and its Python dependencies packed for a CUDA machine without a network,
  and the proof that the pack holds every SGLang module the tests import.
"""
