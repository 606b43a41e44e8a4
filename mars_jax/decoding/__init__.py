"""Decoding, one job per module (`mars_jax.sampling.generate` is the front door):
loop (jitted kernels), gates (acceptance), draws (greedy or sampled tokens), stops
(stop strings), batching (host buckets, checks, results), timing (step costs),
window_policy and rounds (steps at the window a policy chooses), mesh (shardings),
speculative (two-model decoding). Not a server: requests arriving over time are
mars_jax.serve's (docs/serving.md)."""
