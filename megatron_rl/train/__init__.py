"""The RL training loop (`megatron-rl train`), by owner: `loop` (train / learn / publish) over
`Policy` (actor + reference), `RolloutFleet` (the servers), `RunDir` (files, checkpoints, stopping),
`data`, `batch` and `metrics`."""
