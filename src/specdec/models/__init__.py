"""Networks specdec owns: their configs, weights in the published layout, and forward passes.

``llama`` is the native forward pass of the Llama family (llama, qwen2, qwen3, mistral); the
backend that runs it on a ragged KV cache is ``specdec.backends.native``.
"""
