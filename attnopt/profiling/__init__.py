"""``attnopt profile``: where time and memory go, per batch size, sequence length and phase.

``spec`` resolves what to profile, ``measure`` times and profiles one point, ``breakdown`` says where
a profiled call's time goes (ops, modules, attention), ``sweet_spot`` reads throughput over batch
sizes, ``report`` writes the table, summary and JSON, ``plots`` the PNGs, ``html`` the page,
``run`` sweeps the points, ``cli`` is the command line, ``compare`` compares two reports.
"""
