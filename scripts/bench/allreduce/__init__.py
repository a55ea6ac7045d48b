"""scripts/bench/bench_allreduce.py by section: its options and columns (``options``), one rank's measurements
(``worker``), the launch of a setting's ranks (``launch``) and the figures (``figures``)."""
