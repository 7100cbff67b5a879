"""What lives in Redis and how it is found.

metadata, key templates, liveness, rebuild, the embedded Redis.
"""
