"""Graph passes over captured FX graphs, one per file; each says what it matches and what it emits.

``canon`` (the canonical vocabulary every spelling is read into), ``shapes`` (every node gets a
shape), ``find_sites`` (the matcher: a table of named rules per softmax), ``masks`` (the mask
planner and its causality proofs), ``rewrite_sdpa`` (each proven site to a site module), ``mha``
(``nn.MultiheadAttention`` weights no longer read), ``verify`` (rewritten vs original outputs),
``positions`` (the KV cache's position analysis), ``kv_capture`` (the KV cache's capture), ``hop``
(attention inside higher-order op bodies: activation checkpointing, ``wrap``).
"""
