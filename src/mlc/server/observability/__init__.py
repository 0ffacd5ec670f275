"""What the server tells its operators: Prometheus metrics, the dashboard's history, the audit log and
post-inference hooks."""
