"""Every test session is one deployment: one cluster secret (protos/auth.py) in the environment,
so in-process routers and the worker processes tests start (they inherit it) trust each other."""
from __future__ import annotations

import os

from protos.auth import SECRET_ENV, new_secret

os.environ.setdefault(SECRET_ENV, new_secret())
