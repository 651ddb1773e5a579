"""Deployment: the `tandem` CLI, and (later) the Ray controller, launchers and cluster YAMLs."""
from protos.grpc_io import use_polling_io

use_polling_io()   # before anything imports grpc (protos/grpc_io.py)
