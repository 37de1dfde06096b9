"""``attnopt profile``: where time and memory go, per batch size, sequence length and phase.

``spec`` resolves what to profile, ``measure`` times and profiles one point, ``report`` writes the
table, summary, JSON and plots, ``run`` sweeps the points, ``cli`` is the command line.
"""
