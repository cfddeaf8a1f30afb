"""The harness: quality, GPU, speed targets, soaks and the peers' adapters. Never imported by the product.

Run its modules from the repository root, e.g. ``python -m benchmarks.quality --help``.
"""
