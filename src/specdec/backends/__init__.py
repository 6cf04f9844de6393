"""The target and how it runs: ``target`` (loading, the facts generation needs), ``cache`` (ragged KV
bookkeeping with one rollback primitive), ``native`` (specdec's own forward pass on the kernels) and
``hf`` (transformers' model, the fallback for every other architecture)."""
