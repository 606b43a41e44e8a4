"""Every checkpoint read or written: Hugging Face directories (`hf`: config.json,
safetensors through `safetensors_io`, the tokenizer with `<|mask|>`, export markers),
PEFT adapter directories (`peft`), and training runs' directories (`runs`: layout.json,
finding a step, reading its params). Below both training and inference, so that loading
a model never reaches into training; saving a run as it trains is
mars_jax.training.checkpoint's."""
