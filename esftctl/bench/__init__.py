"""`esftctl bench`: measurements against the baselines, as rich tables, JSON and plots."""
