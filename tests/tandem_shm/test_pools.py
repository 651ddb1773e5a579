"""tandem_shm.pools: a new pool file is 0600 and fully backed, or an error with no file left; the
pools of a dead process are found by its pid and removed, a live one's never by the sweep.

Pool files here live in pytest's tmp_path, not /dev/shm (the engine's and kvtransfer's pools in
/dev/shm are tests/engine/test_kv_pool_space.py and tests/kvtransfer/test_shm_*.py)."""
from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest

from tandem_shm.pools import POOL_NAME, create_pool_file, pool_name, pools_of, remove_pools_of, sweep_dead_pools


def _dead_pid() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


def test_pool_names_carry_the_owner_pid():
    assert POOL_NAME.fullmatch(pool_name()) and pool_name().startswith(f"tandem-kv-{os.getpid()}-")
    assert pool_name(7).startswith("tandem-kv-7-") and pool_name(7) != pool_name(7)


def test_a_new_pool_file_is_private_and_fully_backed(tmp_path):
    old = os.umask(0)
    try:
        path = create_pool_file(1 << 20, tmp_path)
    finally:
        os.umask(old)
    st = os.stat(path)
    assert os.path.dirname(path) == str(tmp_path) and POOL_NAME.fullmatch(os.path.basename(path))
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 1 << 20 and st.st_blocks * 512 >= 1 << 20


def test_a_pool_that_does_not_fit_is_enospc_and_leaves_no_file(tmp_path):
    st = os.statvfs(tmp_path)
    with pytest.raises(OSError) as err:
        create_pool_file(st.f_bavail * st.f_frsize + (1 << 30), tmp_path)
    assert err.value.errno == errno.ENOSPC and "GiB needed" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_a_name_not_of_a_pool_is_refused(tmp_path):
    with pytest.raises(ValueError, match="use pool_name"):
        create_pool_file(4096, tmp_path, name="tandem-kv-../../etc/x")
    assert list(tmp_path.iterdir()) == []


def test_the_pools_of_one_pid_are_found_and_removed(tmp_path):
    dead = _dead_pid()
    mine = [tmp_path / pool_name(dead), tmp_path / pool_name(dead)]
    others = [tmp_path / pool_name(dead * 10 + 1), tmp_path / pool_name(os.getpid())]
    for path in mine + others:
        path.write_bytes(b"x")
    assert pools_of(dead, tmp_path) == sorted(mine)
    assert remove_pools_of(dead, tmp_path) == sorted(mine)
    assert pools_of(dead, tmp_path) == [] and all(p.exists() for p in others)


def test_pools_of_dead_processes_are_swept(tmp_path):
    stale = tmp_path / f"tandem-kv-{_dead_pid()}-abc"
    alive = tmp_path / f"tandem-kv-{os.getpid()}-def"
    other = tmp_path / "tandem-kv-notapid-x"
    for path in (stale, alive, other):
        path.write_bytes(b"x")
    assert sweep_dead_pools(tmp_path) == [stale]
    assert not stale.exists() and alive.exists() and other.exists()
