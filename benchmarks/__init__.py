"""Benchmarks (not tests): offline throughput, scheduler step time, and the shared workload."""
