"""The fidelity report (scripts/reporting/fidelity_report.py) by section: the runs and their summaries
(``runs``), the report's text (``report``), the batch-scaling study (``batch_scaling``), the figures (``figures``)."""
