"""A saved benchmark run turned into ratios, tables, a comparison and the performance page.

Nothing here imports normlab or times anything, so a saved run can be reported on any machine.
From the bottom up:

- ``runs``: a saved run's JSON, the names in it and its timed calls as saved;
- ``metrics``: each call's ratios to the references beside it (GB/s, % of copy, × torch, × best
  peer), their geometric means, the default's gaps to the peers, and two runs compared;
- ``tables``: the tables of the report and of a comparison, rendered in Markdown;
- ``terminal``: the report and the comparison on the terminal;
- ``page``: ``docs/performance.md``, its prose in ``templates/``.
"""
