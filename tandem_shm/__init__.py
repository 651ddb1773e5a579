"""Shared-memory KV pool files (pools.py): below engine and kvtransfer, standard library only.

A leaf package so that engine (which creates a CPU worker's pool), kvtransfer (which maps another
process's pool and makes pools for its tests) and the launchers (which remove a dead child's
pools) hold one definition of the pool directory, the pool names and how a pool is made, though
engine and kvtransfer may not import each other (docs/architecture.md#packages-and-import-direction).
"""
