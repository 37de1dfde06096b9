"""What a rewritten graph calls at run time: site modules, their guards and dispatch, the KV-cache site.

``dispatch`` (the per-call dispatch every site kind shares: choice, reference check, fallbacks),
``site`` (the rewritten site), ``guards``, ``autograd`` (backward fallbacks), ``kv_cache`` and
``cached_lm`` (generation).
"""
