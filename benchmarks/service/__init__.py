"""The service benchmark's parts, one module each; ``benchmarks/service_bench.py`` runs them and writes
``benchmarks/results/service.json``.

- ``submissions``: POST /v1/experiments throughput and latency at C concurrent clients.
- ``sse``: one job's event stream fanned out to N followers.
- ``decisions``: the scheduler's decision time with 1,000 queued jobs.
- ``startup``: submit to first epoch on an idle local stack, split into queue, Ray job start, worker start.
- ``common``: sizes, floors, percentiles, CPU meters, the API-only stack.
"""
