"""Benchmarks (not tests): `python -m bench.store_gather --size-gb 1`."""
