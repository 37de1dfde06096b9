"""The routes: each is a short list of named steps over a captured graph.

* ``optimize``: copy -> find sites -> drop unread MHA weights -> choose -> rewrite -> attach the
  selector -> verify (``run_pipeline``; the dynamo ``backend`` and ``rewrite()`` call it);
* ``kv``: the KV-cache route (``cached``): capture -> find sites -> keep the causal ones -> rewrite
  -> swap in KV-cache sites -> prove and shift positions -> size the caches -> pin what was read;
* ``steps``: the steps the routes (and the profiler's site brackets) share;
* ``backend``: the dynamo backend (``torch.compile(model, backend="attnopt")``);
* ``rewritten``: the graph module ``rewrite()`` returns, re-proven per input signature;
* ``snapshot``: what ``explain()`` restores after running a model;
* ``report``: the :class:`~attnopt.pipeline.report.Report` the routes fill.
"""
