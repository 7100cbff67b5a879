"""Celery beat: the sweep schedule and the sweeps it runs.

reconcile, checksum_sync, crosscheck, health, retention, garbage collection.
"""
