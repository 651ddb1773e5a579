"""Deployment: the `tandem` CLI, and (later) the Ray controller, launchers and cluster YAMLs."""
