"""A private OpenSSH server on 127.0.0.1 for tests that drive `ray up` against this machine.

Runs in the test process (the server is a child `sshd -D`). It listens on a free port with a
throwaway host key, accepts one throwaway client key for the current user, and gives every
session its own HOME, so whatever a cluster YAML writes under `~` (the Ray bootstrap config and
key, `~/.bashrc`, `~/tandem`) lands in a temp folder instead of the real home.

Ray's cluster launcher has no SSH port setting, only `auth.ssh_proxy_command`; run as a script,
this module is that proxy: `python sshd.py HOST PORT` relays stdin/stdout to HOST:PORT.
"""
from __future__ import annotations

import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REQUIRED_BINARIES = ("sshd", "ssh", "ssh-keygen", "rsync")
_SSHD_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])


def missing_binaries() -> list[str]:
    return [name for name in REQUIRED_BINARIES if shutil.which(name, path=_SSHD_SEARCH_PATH) is None]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateSshd:
    """`sshd -D` on 127.0.0.1:<free port>, key login for the current user only.

    `home` is the HOME of every session; `client_key` the private key to log in with;
    `proxy_command` the value for Ray's `auth.ssh_proxy_command`.
    """

    def __init__(self, root: Path, start_timeout_s: float = 30.0):
        self.root = root
        self.home = root / "home"
        self.client_key = root / "client_key"
        self.user = getpass.getuser()
        self.port = free_port()
        script = shlex.quote(str(Path(__file__).resolve()))
        self.proxy_command = f"{shlex.quote(sys.executable)} {script} %h {self.port}"
        self._log = root / "sshd.log"
        self._make_keys_and_config()
        with open(self._log, "wb") as log:  # sshd -e: its log goes to stderr
            self._proc = subprocess.Popen(
                [sshd_binary(), "-D", "-e", "-f", str(root / "sshd_config")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        try:
            self._wait_until_login_works(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _make_keys_and_config(self) -> None:
        self.home.mkdir(parents=True)
        (self.home / ".bashrc").touch()  # Ray's commands source it
        make_keys(self.root, "host_key", "client_key")
        (self.root / "authorized_keys").write_text((self.root / "client_key.pub").read_text())
        (self.root / "sshd_config").write_text(sshd_config(
            f"127.0.0.1:{self.port}", self.root / "host_key", self.root / "sshd.pid",
            self.root / "authorized_keys", self.user, self.home))

    def ssh_command(self, *remote: str) -> list[str]:
        return [shutil.which("ssh", path=_SSHD_SEARCH_PATH), "-i", str(self.client_key),
                "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={os.devnull}",
                "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-p", str(self.port),
                f"{self.user}@127.0.0.1", *remote]

    def _wait_until_login_works(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"sshd exited with code {self._proc.returncode}: {self.log_text()}")
            probe = subprocess.run(self.ssh_command("echo", "$HOME"), capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                if probe.stdout.strip() != str(self.home):
                    raise RuntimeError(f"sshd sessions get HOME={probe.stdout.strip()!r}, not {self.home}")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot log in to the private sshd: {probe.stderr}\n{self.log_text()}")
            time.sleep(0.2)

    def log_text(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the listener, its session processes, and the ssh clients logged in with our key
        (Ray keeps ControlMaster connections open for a while after its last command)."""
        table = process_table()
        key = str(self.client_key).encode()
        victims = [pid for pid, (_, argv) in table.items() if key in argv.split(b"\0")]
        victims += _descendants(table, self._proc.pid)
        self._proc.terminate()
        terminate(victims, timeout_s)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def make_keys(root: Path, *names: str) -> None:
    """Throwaway ed25519 key pairs root/<name> and root/<name>.pub (no passphrase)."""
    keygen = shutil.which("ssh-keygen", path=_SSHD_SEARCH_PATH)
    for name in names:
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)


def sshd_config(listen: str, host_key: Path, pid_file: Path, authorized_keys: Path, user: str, home: Path) -> str:
    """An sshd_config for key login as ``user`` only, every session with HOME=``home``."""
    if os.geteuid() == 0:
        # A root sshd refuses to start without its privilege-separation directory, which
        # only the system's ssh service creates.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    return "\n".join([
        f"ListenAddress {listen}",
        f"HostKey {host_key}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        f"AllowUsers {user}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        # The keys live under /tmp, which is world-writable; StrictModes would reject them.
        "StrictModes no",
        f"SetEnv HOME={home}",
        "",
    ])


def sshd_binary() -> str:
    found = shutil.which("sshd", path=_SSHD_SEARCH_PATH)
    if found is None:
        raise RuntimeError("sshd is not installed (apt-get install openssh-server)")
    return found


def process_table() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, NUL-separated argv), read from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            argv = (entry / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        # stat is "pid (comm) state ppid ...", and comm may itself hold spaces or parentheses.
        parent_pid = int(stat[stat.rindex(b")") + 2:].split()[1])
        table[int(entry.name)] = (parent_pid, argv)
    return table


def processes_with_env(entry: str) -> list[int]:
    """Pids of the processes whose environment holds `entry` (e.g. "HOME=/tmp/x/home")."""
    wanted, found = entry.encode(), []
    for pid in process_table():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if wanted in environ.split(b"\0"):
            found.append(pid)
    return found


def _descendants(table: dict[int, tuple[int, bytes]], root_pid: int) -> list[int]:
    found, frontier = [], [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] != b"Z"  # a zombie has already exited


def terminate(pids: list[int], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL whatever is still running after timeout_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)


def relay(host: str, port: int) -> None:
    """Copy stdin to HOST:PORT and HOST:PORT to stdout until the server closes."""
    sock = socket.create_connection((host, port))

    def upstream() -> None:
        while chunk := os.read(0, 65536):
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    while chunk := sock.recv(65536):
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    relay(sys.argv[1], int(sys.argv[2]))
