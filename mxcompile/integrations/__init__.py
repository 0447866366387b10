"""Integrations with training stacks around the model. Each submodule imports its stack
(`mxcompile.integrations.hf` imports transformers); this package imports none of them."""
