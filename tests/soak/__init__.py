"""A seeded soak with an exact oracle (issue 41): random jobs of real writer processes,
faults and all, checked command by command against what each rank recorded and which
flush() returned.

* ``generator``: a job from a seed (``random.Random(seed)`` and nothing else);
* ``worker``: one rank of a job, a real process, keeping a ledger of what it recorded
  and what its flushes acknowledged;
* ``oracle``: the ledgers read back, rewound as the reader rewinds restarts, and every
  statistic computed exactly with ``fractions``;
* ``checks``: each command's output against the oracle;
* ``runner``: runs jobs (the ranks, the faults, the hang's end, the uploads beside them),
  then the commands and checks; ``python -m tests.soak --seed N`` or ``--minutes M``
  (``make soak``).

``seeds.txt`` lists the seeds the suite replays (``tests/test_soak.py``).
"""
