"""The training state beyond the tensors, and what a bitwise resume depends on: the Guard's named
``Stateful`` parts (:mod:`~trainguard.state.trainstate`), RNG capture and the state hash
(:mod:`~trainguard.state.determinism`), what a checkpoint cannot restore
(:mod:`~trainguard.state.fidelity`), and resuming on another world size
(:mod:`~trainguard.state.reshard`)."""
