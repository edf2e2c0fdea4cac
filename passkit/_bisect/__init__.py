"""``passkit bisect``: from a wrong output or a broken compile to the rewrite that caused it.

:mod:`.search` drives the binary search over ``bisect_limit`` (:mod:`passkit.rewrite_counter`),
each probe in fresh processes (:mod:`.probe`); :mod:`.repro` writes a standalone reproducer
of the culprit pass on the graph it saw.
"""

COUNT_ALL = 10**12
"""The limit of the probe that counts every rewrite (all allowed)."""
