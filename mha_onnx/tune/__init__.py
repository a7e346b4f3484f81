"""Tuning: the forms chosen on the machine that runs them (``fuse --tune``, ``tune``).

- ``rules``: what the tuner chooses from a timing table (the rules, the dispatch's own cost);
- ``plan``: what a tuning may cost and must earn (noise, size budget, time budget);
- ``timing``: the candidates timed on this machine (two passes, departures timed again);
- ``dispatch``: the dispatching model (one If branch per candidate);
- ``run``: the whole run, from the original to the verified tuned file.
"""
