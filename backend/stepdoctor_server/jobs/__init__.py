"""Work off the request path: SQL claims (claims), the embedded worker pool (pool), procrastinate on PostgreSQL (procrastinate_app) and per-job limits (limits)."""
