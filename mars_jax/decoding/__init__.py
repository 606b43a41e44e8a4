"""The decoding loop, one job per module (`mars_jax.sampling.generate` is the front door):
loop (jitted kernels), batching (host buckets, checks, results), timing (step costs),
rounds (steps at the window a policy chooses)."""
