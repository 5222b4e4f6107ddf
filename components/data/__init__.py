"""Room data: what the stages read and write, shared by them all.

Traffic in every form (traffic_io: JSON Lines and its rules; traffic_sources: Parquet, Arrow, saved datasets), chat
rendering with the target's template (chat), the regenerated conversations' shard files (regenerated), captured
serving traffic (capture_records: the capture files' rows; captured_traffic: them as the next head's training data),
and the file rules every stage follows (atomic: writes a reader sees whole; safe_read: user files within caps).
Imports no stage room. Nothing is re-exported here: import the module.
"""
