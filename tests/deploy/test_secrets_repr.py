"""No config dataclass prints a secret: the API key and the cluster secret are ``repr=False`` in
every config that holds them (deploy/controller.py ServeSpec, router/config.py RouterConfig,
worker/config.py WorkerConfig), so a log line or a Ray error that shows a config does
not show them."""
from __future__ import annotations

import dataclasses

from deploy.controller import ServeSpec
from router.config import RouterConfig
from worker.config import WorkerConfig

API_KEY = "sk-test-api-key-that-must-not-print"
SECRET = "cluster-secret-that-must-not-print-0123456789"


def test_serve_spec_repr_hides_the_api_key_and_cluster_secret():
    spec = ServeSpec(model="m", replicas={"prefill": 1, "decode": 1}, tp={"prefill": 1, "decode": 1},
                     worker_flags=[], router_flags=[], api_key=API_KEY, cluster_secret=SECRET)
    for text in (repr(spec), str(spec)):
        assert API_KEY not in text and SECRET not in text
    assert "model='m'" in repr(spec)


def test_router_and_worker_config_repr_hide_their_secrets():
    assert API_KEY not in repr(RouterConfig(api_key=API_KEY))
    assert SECRET not in repr(WorkerConfig(cluster_secret=SECRET))


def test_every_secret_field_of_every_config_is_hidden():
    for cls in (ServeSpec, RouterConfig, WorkerConfig):
        for f in dataclasses.fields(cls):
            if f.type in ("str", str) and any(word in f.name for word in ("key", "secret", "token", "password")):
                assert f.repr is False, f"{cls.__name__}.{f.name} would be printed by repr"
