"""The Celery app and its tasks; enqueue.py is the one place they send each other."""
