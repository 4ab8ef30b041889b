"""An elastic job's keys on its store: written by its processes
(:mod:`collectives.elastic.runtime`), read by them and by a launcher whose ranks are all
gone while the others go on (:mod:`collectives.launcher.supervisor`). Under ``elastic/<job>/``:

``arrivals``          counter: each process's arrival number (its place among newcomers)
``alive/<uid>``       leased by the process: the server deletes it when the process's
                      connection closes (exit, crash, SIGKILL), at once
``g<g>/here``         appended ``<arrival> <uid>`` lines: who came to generation g
``gen/<g>``           the decision: JSON ``{"members": [uid, ...]}``
``latest``            the newest decided generation (where newcomers start looking)
``g<g>/abort``        set when generation g is broken: by a member that caught a DistError,
                      or by the server when a member's lease connection closes; every
                      member's watcher thread then interrupts its groups, so no rank
                      waits out a timeout on a dead peer
``g<g>/pg/...``       the generation's default group meets here
``done``              set by each process that leaves the job normally (its training
                      function returned)
"""
import json


def prefix(job):
    return f"elastic/{job}/"


def here_entries(text):
    """A ``g<g>/here`` value's [(arrival, uid)], in the order they were appended."""
    out = []
    for line in text.decode().splitlines():
        a, _, uid = line.partition(" ")
        if uid:
            out.append((int(a), uid))
    return out


def done_key(job):
    """Set by each process that leaves the job normally."""
    return prefix(job) + "done"


def gen_key(job, g):
    """Generation g's decision."""
    return prefix(job) + f"gen/{g}"


def members_of(store, job, g):
    """Generation g's decided members (uids in rank order); the decision must exist (a get
    of a missing key waits out the store's timeout)."""
    return json.loads(store.get(gen_key(job, g)))["members"]


def decided(store, job, g):
    """Generation g's decided members (uids in rank order), or None if not decided."""
    return members_of(store, job, g) if store.check([gen_key(job, g)]) else None


def decide(store, job, g, uids):
    """Write generation g's decision (the first writer's stands) and point ``latest`` at it
    (where newcomers start looking)."""
    store.compare_set(gen_key(job, g), b"", json.dumps({"members": uids}).encode())
    store.set(prefix(job) + "latest", str(g))


def latest(store, job, default):
    """The newest decided generation, or ``default`` if none is."""
    key = prefix(job) + "latest"
    return int(store.get(key)) if store.check([key]) else default


def job_alive(store, job):
    """Whether a process of the job holds its lease on ``store``: a member of its latest
    generation, or one that came to the next (a lease lasts until the process exits, after
    its training too). A watcher outside the processes reads it there."""
    p = prefix(job)
    g = latest(store, job, -1)
    uids = (decided(store, job, g) or []) if g >= 0 else []
    if store.check([p + f"g{g + 1}/here"]):
        uids += [u for _, u in here_entries(store.get(p + f"g{g + 1}/here"))]
    return any(store.check([p + f"alive/{u}"]) for u in uids)
