"""The parallel runtime: the device mesh and the logical-axis rules that map weights and
activations onto it (`sharding`: `make_mesh`, `MeshConfig`), several processes
(`distributed`: jax.distributed from the config, the environment, SLURM or TPU), and the
TPU and GPU chips with their compile-only devices (`hardware`). Above the models (whose
logical axes it maps), below data, training and decoding."""
