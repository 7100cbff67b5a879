"""The shard server on every storage node; standard library only.

protocol (pure), wire, session, blob store, server.
"""
