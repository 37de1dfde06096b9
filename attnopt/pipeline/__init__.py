"""The routes: each is a short list of named passes over a captured graph.

* ``optimize``: copy -> shapes -> bind example values -> find sites -> choose -> rewrite -> attach
  the selector -> verify (``run_pipeline``; the dynamo ``backend`` and ``rewrite()`` call it);
* ``kv``: the KV-cache route (``cached``);
* ``rewritten``: the graph module ``rewrite()`` returns, re-proven per input signature;
* ``snapshot``: what ``explain()`` restores after running a model;
* ``report``: the :class:`~attnopt.pipeline.report.Report` all routes fill.
"""
