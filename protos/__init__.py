"""Protocol buffer sources and generated stubs for the control plane.

Placeholder until the worker and router issues land.
"""
