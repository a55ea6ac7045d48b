"""scripts/reporting/costmodel_report.py by section: the flat model on GPU nodes (``flat``) and the two tiers
(``two_tier``); the report's order and its command stay in costmodel_report.py."""
