"""The RL training loop (`megatron-rl train`), by owner: `loop` (train / learn / publish) over
`Policy` (actor + reference), `RolloutFleet` (the servers), `WeightPublisher` (the weights they
hold), `RunDir` (files, checkpoints, stopping), `data`, `batch` and `metrics`."""
