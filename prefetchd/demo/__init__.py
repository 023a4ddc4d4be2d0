"""`prefetchd demo`: the demo transformer (model) and the job that streams it (run)."""
