"""The training machine's side.

plan/ -> dataplane/ move the bytes, state/ keeps Redis, cli/ and local/ sit on top.
"""
