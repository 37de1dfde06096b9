"""What a rewritten graph calls at run time: site modules, their guards and dispatch, the KV-cache site.

``site`` (the per-call dispatch every site kind shares), ``guards``, ``autograd`` (backward
fallbacks), ``kv_cache`` and ``cached_lm`` (generation).
"""
