"""Spark side of checkpoint-sidecar: a StreamingQueryListener that posts offsets to the daemon.

(Arrives with the Spark bridge issue; the daemon's protocol module is what it will speak.)
"""
