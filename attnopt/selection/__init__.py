"""Choosing by measurement: the selector, shape keys, trials, the tuning cache, distributed agreement.

``selector`` times the legal candidates of a site per shape key and keeps the fastest within the
memory budget; ``cache`` keeps the results on disk under a key of attnopt, torch, device and
candidates; ``measure`` holds the timers and the peak-memory meter; ``distributed`` makes every
rank take the same choice.
"""
