"""Decoding, one job per module: sampler (`generate`, which outside code imports as
`mars_jax.sampling.generate`), loop (jitted kernels), gates (acceptance), draws (greedy
or sampled tokens), stops (stop strings), batching (host buckets, checks, results),
prompts (per-prompt seeds and token budgets), timing (step costs), window_policy and
rounds (steps at the window a policy chooses), mesh (shardings), speculative (two-model
decoding), loading (a model for inference from an HF directory or a run). Not a server:
requests arriving over time are mars_jax.serve's (docs/serving.md)."""
