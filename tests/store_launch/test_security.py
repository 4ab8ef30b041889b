"""Only a job's own processes can join it: the store and the TCP transport refuse a
connection that does not prove it holds the job's key, listen only where asked, and
survive garbage, oversized lengths, idle connections and floods; the object calls can
refuse anything but data."""
import hashlib
import json
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives.security import auth, safe_pickle
from collectives import config
from collectives.security.auth import AuthError
from collectives.backends.tcp import mesh, mesh_accept
from collectives.backends.tcp import connect_mesh
from collectives.core.errors import DistNetworkError
from collectives.store import (
    MAX_FRAME, OP_GET, OP_SET, PROTOCOL_VERSION, HashStore, PrefixStore, TCPStore, encode_request,
)
from collectives.store import server as store_server
from tests.support import ROOT  # noqa: E402
from tests.store_launch import test_multinode as mn
from tests.store_launch.test_multinode import nodes  # noqa: F401  (the two network namespaces)
from tests.support.profiles import examples  # noqa: E402
from tests.support.requires import needs_gloo  # noqa: E402

TARGET = os.path.join(ROOT, "tests", "support", "scripts", "security_target.py")
KEY = b"0123456789abcdef0123456789abcdef"


# ---- helpers ------------------------------------------------------------------------------

def _raw(port, host="127.0.0.1"):
    s = socket.create_connection((host, port), timeout=5)
    s.settimeout(5)
    return s


def _recv_all(s, limit=1 << 16):
    """Everything the peer sends until it hangs up (or 5 s pass)."""
    out = b""
    try:
        while len(out) < limit:
            chunk = s.recv(4096)
            if not chunk:
                break
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return out


def _hangs_up(s, within):
    """Whether the peer closes ``s`` within ``within`` seconds (reading what it sends)."""
    s.settimeout(within)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.fixture(autouse=True)
def _no_key_in_the_environment(monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    monkeypatch.delenv(safe_pickle.SAFE_ENV, raising=False)


def _authenticated_raw(port, key=KEY):
    s = _raw(port)
    auth.client_handshake(s, key, time.monotonic() + 5, "test")
    return s


def _roundtrip(s, op, args):
    s.sendall(encode_request(op, args))
    n, = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
    return s.recv(n, socket.MSG_WAITALL)


@pytest.fixture
def keyed_master():
    master = TCPStore("127.0.0.1", 0, None, True, timeout=5, auth_key=KEY)
    master.set("alive", "yes")
    yield master
    master.close()


def _still_serves(port, key=KEY):
    """A legitimate client gets correct answers from the server on ``port``."""
    c = TCPStore("127.0.0.1", port, timeout=5, auth_key=key)
    try:
        assert c.get("alive") == b"yes"
        n = c.add("counter", 1)
        assert c.add("counter", 0) == n
        c.set("fresh", b"\x00\xff")
        assert c.get("fresh") == b"\x00\xff"
    finally:
        c.close()


# ---- the key ----------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("key", [None, b"not the key", "also wrong"])
def test_store_refuses_a_client_without_the_key(keyed_master, key, monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    with pytest.raises(AuthError, match="authentication"):
        c = TCPStore("127.0.0.1", keyed_master.port, timeout=5, auth_key=key)
        c.get("alive")  # a keyless client learns at its first request
    _still_serves(keyed_master.port)


@pytest.mark.timeout(30)
def test_a_keyless_frame_never_reads_or_writes_a_key(keyed_master):
    s = _raw(keyed_master.port)
    s.sendall(encode_request(OP_SET, [b"alive", b"hijacked"]) + encode_request(OP_GET, [b"alive", b"0"]))
    reply = _recv_all(s)
    s.close()
    assert reply[4] == 3 and auth.REFUSED_MARK.encode() in reply  # ST_REJECTED, then hung up
    assert b"yes" not in reply
    _still_serves(keyed_master.port)


@pytest.mark.timeout(30)
def test_a_client_with_a_key_refuses_a_server_without_one(monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    plain = TCPStore("127.0.0.1", 0, None, True, timeout=5)
    with pytest.raises(AuthError, match="does not authenticate"):
        TCPStore("127.0.0.1", plain.port, timeout=5, auth_key=KEY)
    plain.close()


@pytest.mark.timeout(30)
def test_without_any_key_nothing_changes(monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    master = TCPStore("127.0.0.1", 0, None, True, timeout=5)
    s = _raw(master.port)  # a plain frame is served, as torch's TCPStore would
    body = _roundtrip(s, OP_SET, [b"k", b"v"])
    assert body[0] == 0
    s.close()
    assert master.get("k") == b"v"
    master.close()


@pytest.mark.timeout(30)
def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    master = TCPStore("127.0.0.1", 0, None, True, timeout=5)  # no auth_key: the environment's
    with pytest.raises(AuthError):
        TCPStore("127.0.0.1", master.port, timeout=5, auth_key="other")
    c = TCPStore("127.0.0.1", master.port, timeout=5, auth_key=KEY)
    c.set("a", "1")
    assert master.get("a") == b"1" and c.clone().get("a") == b"1"
    master.close()


def test_bad_keys_are_refused_before_any_connection():
    with pytest.raises(ValueError, match="auth_key"):
        TCPStore("127.0.0.1", 1, timeout=1, auth_key=b"")
    with pytest.raises(TypeError, match="auth_key"):
        TCPStore("127.0.0.1", 1, timeout=1, auth_key=1234)


@pytest.mark.timeout(30)
def test_a_refusal_is_one_log_line(keyed_master, caplog):
    keyed_master._server._refusals.last = -1e18  # (other tests may have logged just now)
    with caplog.at_level(logging.WARNING, logger="collectives.auth"):
        for _ in range(5):
            with pytest.raises(AuthError):
                TCPStore("127.0.0.1", keyed_master.port, timeout=5, auth_key="wrong")
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines  # five refusals, one line: a flood cannot flood the log
    assert "refused a connection from 127.0.0.1" in lines[0] and "wrong key" in lines[0]
    assert KEY.decode() not in lines[0] and "wrong" not in lines[0].split(":", 1)[0]


@settings(max_examples=examples(30), deadline=None)
@given(cuts=st.lists(st.integers(1, 71), max_size=4), flip=st.integers(-1, 31))
def test_server_handshake_accepts_the_key_in_any_chunking_and_nothing_else(cuts, flip):
    hs = auth.ServerHandshake(KEY)
    nc = os.urandom(auth.NONCE)
    hello = auth.MAGIC + nc
    out = b""
    done = None
    pos = 0
    for c in sorted(set(c for c in cuts if c < len(hello))) + [len(hello)]:
        o, done, _ = hs.feed(hello[pos:c])
        out += o
        pos = c
    assert done is None and out[:len(auth.MAGIC)] == auth.MAGIC
    ns, smac = out[len(auth.MAGIC):-auth.MAC], out[-auth.MAC:]
    assert smac == auth._mac(KEY, b"server", nc, ns)
    proof = bytearray(auth._mac(KEY, b"client", nc, ns))
    if flip >= 0:
        proof[flip] ^= 1
    o, done, rest = hs.feed(bytes(proof) + b"next")
    if flip >= 0:
        assert o == auth.REFUSED and isinstance(done, str)
    else:
        assert o == auth.OK and done is True and rest == b"next"


# ---- where the store listens -----------------------------------------------------------

def _listening_addresses(port):
    """The local addresses of the LISTEN sockets on ``port``, from /proc/net/tcp{,6}."""
    found = []
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, p = f[1].split(":")
            if f[3] == "0A" and int(p, 16) == port:
                raw = bytes.fromhex(addr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, raw))
    return found


@pytest.mark.timeout(30)
def test_a_store_for_loopback_listens_only_there():
    master = TCPStore("127.0.0.1", 0, None, True, timeout=5)
    assert master._server._lsock.getsockname()[0] == "127.0.0.1"
    assert _listening_addresses(master.port) == ["127.0.0.1"]
    master.close()
    everywhere = TCPStore("0.0.0.0", 0, None, True, timeout=5)
    assert _listening_addresses(everywhere.port) in (["::"], ["0.0.0.0"])
    everywhere.close()


@pytest.mark.timeout(30)
def test_a_store_for_an_ipv6_address_listens_there():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    master = TCPStore("::1", 0, None, True, timeout=5, auth_key=KEY)
    assert _listening_addresses(master.port) == ["::1"]
    c = TCPStore("::1", master.port, timeout=5, auth_key=KEY)
    c.set("v6", "yes")
    assert master.get("v6") == b"yes"
    master.close()


# ---- hardened store server -------------------------------------------------------------

@pytest.mark.faults
@pytest.mark.timeout(60)
def test_idle_half_open_connections_are_dropped_after_the_handshake_deadline(monkeypatch):
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 0.5)
    master = TCPStore("127.0.0.1", 0, None, True, timeout=5, auth_key=KEY)
    master.set("alive", "yes")
    idle = [_raw(master.port) for _ in range(40)]
    half = _raw(master.port)
    half.sendall(auth.MAGIC + b"\x00" * 5)  # half a hello, then silence
    _still_serves(master.port)  # served while they sit there
    for s in idle + [half]:
        assert _hangs_up(s, 10)
        s.close()
    assert not master._server._pending
    _still_serves(master.port)
    master.close()


@pytest.mark.timeout(60)
def test_a_flood_of_connections_evicts_the_oldest_handshakes(keyed_master):
    n = store_server.MAX_PENDING + 20
    flood = [_raw(keyed_master.port) for _ in range(n)]
    _still_serves(keyed_master.port)
    assert len(keyed_master._server._pending) <= store_server.MAX_PENDING
    assert all(_hangs_up(s, 5) for s in flood[:20])  # the oldest were let go
    assert not any(_hangs_up(s, 0.05) for s in flood[-5:])  # the newest still wait their turn
    for s in flood:
        s.close()
    _still_serves(keyed_master.port)


@pytest.mark.timeout(30)
def test_an_oversized_length_is_refused_before_allocating():
    master = TCPStore("127.0.0.1", 0, None, True, timeout=5)
    master.set("alive", "yes")
    s = _raw(master.port)
    s.sendall(struct.pack("!I", MAX_FRAME + 1) + b"x" * 16)
    reply = _recv_all(s)
    assert reply[4] == 3 and b"frame length" in reply
    s.close()
    _still_serves(master.port, key=None)
    master.close()


_FRAMES = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda n, tail: struct.pack("!I", n) + tail, st.integers(0, 2**32 - 1), st.binary(max_size=32)),
    st.builds(lambda v, op, nargs, tail: (struct.pack("!I", 6 + len(tail))
                                          + struct.pack("!BBI", v, op, nargs) + tail),
              st.sampled_from([PROTOCOL_VERSION, 0, 255]), st.integers(0, 255), st.integers(0, 2**32 - 1),
              st.binary(max_size=24)),
    st.builds(lambda frame, i, b: frame[:i] + bytes([b]) + frame[i + 1:],
              st.sampled_from([encode_request(OP_SET, [b"k", b"v"]),
                               encode_request(OP_GET, [b"alive", b"100"])]),
              st.integers(0, 20), st.integers(0, 255)),
)


@pytest.fixture(scope="module")
def fuzz_servers():
    plain = TCPStore("127.0.0.1", 0, None, True, timeout=5, auth_key=None)
    keyed = TCPStore("127.0.0.1", 0, None, True, timeout=5, auth_key=KEY)
    for m in (plain, keyed):
        m.set("alive", "yes")
    yield plain, keyed
    plain.close()
    keyed.close()


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(_FRAMES, min_size=1, max_size=3), hang_up=st.booleans(), authed=st.booleans())
def test_fuzzed_frames_leave_the_server_serving(fuzz_servers, frames, hang_up, authed):
    plain, keyed = fuzz_servers
    if authed:  # after a good handshake: garbage from a key holder
        s = _authenticated_raw(keyed.port)
    else:
        s = _raw(plain.port if hang_up else keyed.port)
    s.settimeout(0.2)
    try:
        s.sendall(b"".join(frames))
        if not hang_up:
            s.recv(1 << 16)
    except OSError:
        pass
    s.close()
    for port, key in ((plain.port, None), (keyed.port, KEY)):
        c = TCPStore("127.0.0.1", port, timeout=5, auth_key=key)
        assert c.get("alive") == b"yes"
        c.close()


@settings(max_examples=examples(25), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=80), cut=st.integers(0, 80))
def test_mutated_handshakes_are_refused(fuzz_servers, data, cut):
    _, keyed = fuzz_servers
    s = _raw(keyed.port)
    s.settimeout(1)
    s.sendall((auth.MAGIC + data)[:max(1, cut)] if cut % 2 else data)
    got = b""
    try:
        got = s.recv(4096)
        s.sendall(os.urandom(auth.PROOF_SIZE))
        got += _recv_all(s)
    except OSError:
        pass
    s.close()
    if got.startswith(auth.MAGIC):  # a whole hello got a challenge, the random proof a refusal
        assert got[auth.CHALLENGE_SIZE:] in (b"", auth.REFUSED)
    else:
        assert got == b"" or auth.REFUSED_MARK.encode() in got
    c = TCPStore("127.0.0.1", keyed.port, timeout=5, auth_key=KEY)
    assert c.get("alive") == b"yes"
    c.close()


# ---- the transport's mesh -----------------------------------------------------------------

def _mesh(stores, size, timeout, results):
    def run(r):
        try:
            results[r] = connect_mesh(stores[r], r, size, timeout, host="127.0.0.1")
        except Exception as e:  # noqa: BLE001  (reported to the test)
            results[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    return threads


def _close_fds(results):
    for res in results.values():
        if isinstance(res, tuple):
            for fd in res[0]:
                if fd >= 0:
                    os.close(fd)


@needs_gloo
@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", [None, KEY])
def test_the_mesh_forms_while_strangers_hold_its_listener(key, monkeypatch):
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 120.0)  # strangers outlast the setup
    base = HashStore()
    stores = []
    for _ in range(3):
        s = PrefixStore("g", base)
        s._auth_key = key
        stores.append(s)
    results = {}
    threads = _mesh(stores, 3, 20, results)
    threads[0].start()
    base.wait(["g/tcp/0/addr/0"], 10)
    port = int(base.get("g/tcp/0/addr/0").decode().rpartition(":")[2])
    attackers = [_raw(port) for _ in range(30)]  # idle, half-open
    stale = mesh._PREFIX.pack(mesh._MAGIC, mesh.wire_version()) + mesh._HELLO.pack(7, 1, 3)  # another group
    for junk in (b"\xff" * 16, stale, stale + b"trailing", b"GET / HTTP/1.0\r\n\r\n"):
        a = _raw(port)
        a.sendall(junk)
        attackers.append(a)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert all(isinstance(results[r], tuple) for r in range(3)), results
        assert len({results[r][1] for r in range(3)}) == 1
    finally:
        _close_fds(results)
        for a in attackers:
            a.close()


@needs_gloo
@pytest.mark.timeout(60)
def test_a_rank_with_another_key_cannot_join_the_mesh():
    base = HashStore()
    stores = [PrefixStore("g", base), PrefixStore("g", base)]
    stores[0]._auth_key, stores[1]._auth_key = KEY, b"another key"
    results = {}
    threads = _mesh(stores, 2, 3, results)
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    _close_fds(results)
    assert isinstance(results[1], AuthError) and "different key" in str(results[1])
    assert isinstance(results[0], DistNetworkError) and "[1]" in str(results[0])
    assert "turned away" in str(results[0])


@needs_gloo
@pytest.mark.timeout(60)
def test_a_flood_on_the_mesh_listener_evicts_strangers_not_peers(monkeypatch):
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 120.0)
    base = HashStore()
    stores = [PrefixStore("g", base) for _ in range(2)]
    for s in stores:
        s._auth_key = KEY
    results = {}
    threads = _mesh(stores, 2, 20, results)
    threads[0].start()
    base.wait(["g/tcp/0/addr/0"], 10)
    port = int(base.get("g/tcp/0/addr/0").decode().rpartition(":")[2])
    flood = [_raw(port) for _ in range(mesh_accept.MAX_PENDING + 10)]
    threads[1].start()
    for t in threads:
        t.join(30)
    try:
        assert all(isinstance(results[r], tuple) for r in range(2)), results
        assert _hangs_up(flood[0], 5)  # the oldest stranger made room
    finally:
        _close_fds(results)
        for a in flood:
            a.close()


# ---- safe unpickling ---------------------------------------------------------------------

class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_safe_mode_refuses_code_and_keeps_data():
    data = [None, 1, 2.5, "s", b"b", {"a": (1, {2})}, np.arange(4.0), np.float32(1)]
    back = safe_pickle.loads(pickle.dumps(data), True, "rank 1")
    assert back[:6] == data[:6] and np.array_equal(back[6], data[6]) and back[7] == data[7]
    assert back[6].dtype == np.float64 and type(back[7]) is np.float32
    with pytest.raises(pickle.UnpicklingError, match="posix.system from rank 3"):
        safe_pickle.loads(pickle.dumps(_Evil()), True, "rank 3")
    assert safe_pickle.check_safe(None) is False  # torch's behaviour unless asked
    with pytest.raises(TypeError, match="safe"):
        safe_pickle.check_safe("yes")


def test_safe_mode_takes_torch_tensors_but_not_a_hostile_storage():
    torch = pytest.importorskip("torch")
    t = torch.arange(6.0).reshape(2, 3)[:, 1:]
    back = safe_pickle.loads(pickle.dumps([t, torch.float16, torch.device("cpu")]), True, "rank 0")
    assert torch.equal(back[0], t) and back[1] is torch.float16

    class HostileStorage:
        def __reduce__(self):
            return (torch.storage._load_from_bytes, (pickle.dumps(_Evil()),))

    with pytest.raises(pickle.UnpicklingError):
        safe_pickle.loads(pickle.dumps(HostileStorage()), True, "rank 0")


def test_the_safe_setting_parses_as_the_registrys_bool(monkeypatch):
    """COLLECTIVES_SAFE_OBJECTS is a bool by the registry's one rule (0/false/no/off, any
    case, are false; anything else true), as every other bool setting."""
    for raw, want in (("1", True), ("true", True), ("YES", True), ("on", True),
                      ("0", False), ("false", False), ("No", False), ("OFF", False), ("", False)):
        monkeypatch.setenv(safe_pickle.SAFE_ENV, raw)
        assert safe_pickle.check_safe(None) is want, raw
        assert safe_pickle.check_safe(None) is config.get(safe_pickle.SAFE_ENV)
    assert safe_pickle.check_safe(False) is False and safe_pickle.check_safe(True) is True
    monkeypatch.delenv(safe_pickle.SAFE_ENV)
    assert safe_pickle.check_safe(None) is False


# ---- jobs under collectives-run ---------------------------------------------------------

def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        auth.ENV_KEY, safe_pickle.SAFE_ENV)}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["COLLECTIVES_TRANSPORT"] = "tcp"
    env.update(extra)
    return env


def _results(text):
    out = {}
    for line in text.splitlines():
        if "RESULT " in line:
            res = json.loads(line.split("RESULT ", 1)[1])
            out[res["rank"]] = res
    return out


def _wait_files(directory, names, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(directory, n)) for n in names):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the job did not get there:\n" + proc.communicate()[0])
        time.sleep(0.02)


def _attack_port(port, n_idle=20):
    """Idle half-open connections, garbage and oversized lengths; returns the idle ones."""
    idle = [_raw(port) for _ in range(n_idle)]
    for junk in (os.urandom(256), struct.pack("!I", 0xFFFFFFFF) + b"x" * 8, b"\x00" * 3,
                 struct.pack("!I", MAX_FRAME) + b"partial"):
        s = _raw(port)
        try:
            s.sendall(junk)
        except OSError:
            pass
        idle.append(s)  # left open: a slow sender
    return idle


@needs_gloo
@pytest.mark.timeout(180)
def test_a_job_under_attack_keeps_running_with_correct_results(tmp_path):
    """Three ranks; while the mesh forms, every listening port (the store's and each
    accepting rank's) gets idle connections, garbage and oversized lengths; during the
    job the store gets more, and keyless and wrong-key clients, which are refused."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "collectives.run", "-n", "3", "--master-addr", "127.0.0.1", TARGET,
         "attack", "env", str(tmp_path)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    held = []
    try:
        _wait_files(tmp_path, ["listen.0"], proc)
        first = json.load(open(tmp_path / "listen.0"))
        store_port = first["store"]
        assert _listening_addresses(store_port) == ["127.0.0.1"]
        for port in (store_port, first["port"]):
            held += _attack_port(port)
        (tmp_path / "go.0").write_text("")
        _wait_files(tmp_path, ["listen.1"], proc)
        held += _attack_port(json.load(open(tmp_path / "listen.1"))["port"])
        (tmp_path / "go.1").write_text("")
        (tmp_path / "go.2").write_text("")
        time.sleep(0.5)  # the job runs its rounds meanwhile
        held += _attack_port(store_port)
        for key in (None, "wrong key"):
            with pytest.raises(AuthError):
                c = TCPStore("127.0.0.1", store_port, timeout=5, auth_key=key)
                c.set("tcp/0/addr/0", "10.0.0.1:1")  # an attacker rewriting a peer's address
        (tmp_path / "done").write_text("")
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for s in held:
            s.close()
    assert proc.returncode == 0, out
    got = _results(out)
    assert sorted(got) == [0, 1, 2], out
    for r in range(3):
        assert got[r]["bad"] == [] and not got[r]["timed_out"] and got[r]["rounds"] >= 1, got[r]
        assert got[r]["mesh"] == r, got[r]  # each connection to a lower rank authenticated
        assert got[r]["objects"] == [0, 1, 2]
    assert "store server on port" in out and "refused a connection" in out  # logged, once


@needs_gloo
@pytest.mark.timeout(120)
@pytest.mark.parametrize("init", ["env", "tcp", "file"])
def test_the_key_reaches_every_rank_on_every_init_method(init, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "collectives.run", "-n", "3", TARGET, "keys", init, str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    got = _results(out.stdout)
    assert sorted(got) == [0, 1, 2], out.stdout
    digests = {got[r]["key_digest"] for r in range(3)}
    assert len(digests) == 1 and got[0]["key_len"] == 64  # one random 256-bit key per job
    for r in range(3):
        assert got[r]["sum_ok"]
        assert got[r]["mesh"] == r, got[r]  # the transport's connections authenticated
        if init != "file":
            assert got[r]["store"] >= 1, got[r]  # and the store's


@needs_gloo
@pytest.mark.timeout(120)
def test_the_key_file_is_used_and_never_shown(tmp_path):
    key_file = tmp_path / "job.key"
    secret = "k" * 20 + hashlib.sha256(str(tmp_path).encode()).hexdigest()
    key_file.write_text(secret + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "collectives.run", "-n", "2", "--auth-key-file", str(key_file),
         TARGET, "keys", "env", str(tmp_path)], cwd=ROOT, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, out + err
    got = _results(out)
    assert got[0]["key_digest"] == hashlib.sha256(secret.encode()).hexdigest()[:16]
    assert secret not in out and secret not in err


def test_a_missing_key_file_is_an_error_naming_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "collectives.run", "--auth-key-file",
                          str(tmp_path / "nope"), TARGET], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--auth-key-file" in out.stderr and "nope" in out.stderr


@pytest.mark.slow  # quick: the key tests on one node
@pytest.mark.multinode
@needs_gloo
@pytest.mark.timeout(240)
def test_the_c10d_rendezvous_across_two_nodes_uses_the_key(nodes, tmp_path):  # noqa: F811
    key_file = tmp_path / "job.key"
    key_file.write_text("shared-" + "x" * 40)
    c10d = mn.C10D[1]
    procs = [mn.start_node(ns, i, lambda i: c10d(i) + ["--auth-key-file", str(key_file)], "check",
                           tmp_path) for i, (ns, _) in enumerate(nodes)]
    codes, got, out = mn.results(procs, 150)
    assert codes == [0, 0], out
    assert sorted(got) == [0, 1, 2, 3] and all(got[r]["bad"] == [] for r in range(4)), out
    # a launcher holding another key is refused by the rendezvous store at once
    other = tmp_path / "other.key"
    other.write_text("another-" + "y" * 40)
    conf = ["--rdzv-conf", "join_timeout=8,close_timeout=2,read_timeout=5"]
    keys = [key_file, other]
    procs = [mn.start_node(ns, i, lambda i: c10d(i)[:4] + conf + ["--auth-key-file", str(keys[i])],
                           "check", tmp_path) for i, (ns, _) in enumerate(nodes)]
    codes, got, out = mn.results(procs, 90)
    assert codes[1] != 0 and "refused this launcher" in out and "different key" in out, out
    assert got == {}, out


def test_an_address_not_of_this_host_falls_back_to_every_interface(caplog):
    with caplog.at_level(logging.WARNING, logger="collectives.auth"):
        server = store_server.StoreServer(0, None, "192.0.2.1")  # TEST-NET-1: never local
    try:
        assert server._lsock.getsockname()[0] in ("::", "0.0.0.0")
        assert "not an address of this host" in caplog.text
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_client_that_never_reads_its_replies_does_not_grow_the_server():
    master = TCPStore("127.0.0.1", 0, None, True, timeout=5)
    value = os.urandom(1 << 20)
    master.set("big", value)
    master.set("alive", "yes")
    s = _raw(master.port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    n = 100  # 100 MiB of replies asked for, none read yet
    request = encode_request(OP_GET, [b"big", b"1000"])
    sender = threading.Thread(target=lambda: s.sendall(request * n), daemon=True)
    sender.start()
    deadline = time.monotonic() + 20
    while not any(len(c.outbuf) >= store_server.OUT_HIGH for c in list(master._server._conns)):
        assert time.monotonic() < deadline, "the server never buffered 8 MiB of replies"
        time.sleep(0.05)
    time.sleep(0.3)  # it would go on buffering now, were it still reading
    conns = [c for c in list(master._server._conns) if c.outbuf]
    assert conns and max(len(c.outbuf) for c in conns) <= store_server.OUT_HIGH + len(value) + 64
    _still_serves(master.port, key=None)  # the others are served meanwhile
    got = 0
    s.settimeout(10)
    while got < n:  # then every reply arrives, whole and in order
        assert _recv_exact(s, 4) == struct.pack("!I", 9 + len(value))  # status, nargs, length
        body = _recv_exact(s, 9 + len(value))
        assert body[0] == 0 and body[9:] == value
        got += 1
    sender.join(10)
    s.close()
    master.close()


def _recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "the server hung up"
        buf += chunk
    return buf


@pytest.mark.timeout(30)
def test_meet_carries_an_explicit_key_on_every_kind_of_store(tmp_path):
    from collectives.store.rendezvous import meet
    store, _, _ = meet(f"file://{tmp_path}/f", 0, 1, auth_key="file key")
    assert auth.key_of(store, env=False) == b"file key"
    given = HashStore()
    store, _, _ = meet(store=given, rank=0, world_size=2, auth_key=b"given key")
    assert store is given and auth.key_of(PrefixStore("g", store), env=False) == b"given key"
    keyed = TCPStore("127.0.0.1", 0, None, True, timeout=5, auth_key=KEY)
    with pytest.raises(ValueError, match="auth_key differs"):
        meet(store=keyed, rank=0, world_size=2, auth_key="another")
    store, _, _ = meet("tcp://127.0.0.1:0", 0, 1, auth_key=KEY)  # the TCPStore authenticates
    with pytest.raises(AuthError):
        TCPStore("127.0.0.1", store.port, timeout=5, auth_key="wrong")
    store.close()
    keyed.close()
