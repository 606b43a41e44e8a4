"""What every layer shares and nothing depends on: the package's named choices (one
`Literal` type each, `choices`) and the command-line conventions of its CLIs (one-line
errors, `cli`). Imports nothing of mars_jax."""
