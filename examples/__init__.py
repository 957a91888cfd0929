"""Users of trajstore, shipped with it: small training loops and the end-to-end demo.

Installed as `trajstore.examples` (the repository keeps them in `examples/`, apart from the
library in `trajstore/`). Nothing in the library imports them, except `trajstore demo`,
which runs `demo`.

- `tiny_grpo`: a tiny dense GRPO loop with optional capture (docs/capture.md);
- `moe_grpo`: a tiny MoE GRPO loop, bf16 rollout vs fp32 training, captured into a store
  (docs/router.md);
- `hf_moe_r3`, `trl_moe_r3`: R3 on a tiny transformers MoE, a plain loop and through TRL
  (docs/integrations.md);
- `runs`: the skeleton those three share (modes on the command line, each captured into
  a store as its own run);
- `gen_long_run`: synthetic long-run capture directories with injectable faults;
- `oracle`: the GRPO math of docs/replay-math.md transcribed in plain PyTorch, independent of
  `trajstore.replay.kernels`, so tests and benchmarks can check the kernels against it;
- `replay_builders`: mathematically consistent bundles (values from `oracle`) with injectable
  faults, for tests and benchmarks;
- `demo`: the whole job end to end (`trajstore demo`, `make demo`); its fixture bundles from
  the public producer are in `data/relax-v2/`.
"""
