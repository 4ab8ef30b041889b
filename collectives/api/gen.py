"""The generator of :mod:`collectives.api._generated`: the public collectives, written out
from the op table (:data:`collectives.api.opspec.SPECS`).

Run ``python -m collectives.api.gen`` after changing an entry of the table (or
``--check``: exit status 1, and the difference, when the checked-in module is not what the
table makes; ``tests/api/test_opspec.py`` runs the check). The generator imports the
package, so the module it replaces must still import: to add a collective, enter its
OpSpec, regenerate, then export the new function.

From each OpSpec one function is written, the free function. A collective with a path
that is one backend call (:func:`in_place`: all_reduce, broadcast, barrier...) resolves
the group, then runs the body, written in place rather than called, so its common call
(``dist.all_reduce(t)``) has one Python frame and goes straight to the group's dispatcher
(``pg.dispatch.call``: :mod:`collectives.api.group_dispatcher`). A point-to-point call is
one call of :func:`~collectives.api.opspec._post`, which resolves the group by the
same rule, posts and, for send and recv, waits. The others (gather, all_to_all, the
``*_multigpu`` calls...) are one statement,
``return _in_group(group, plan, args...)``: :func:`~collectives.api.opspec._in_group`
resolves the group by the same rule and runs the plan, which checks the buffers and the
root. The ProcessGroup methods (:mod:`collectives.api.pg_methods`) and the ``*_multigpu``
plans call the free function with ``group=`` the group they run on.

A docstring that is one of :mod:`collectives.api.opdocs`' texts is not copied: at its end
the module sets each such function's ``__doc__`` to its entry's ``doc`` (that text), so
each long text has one copy; the table's one-line docstrings are written in place.
"""
import difflib
import os
import sys
import textwrap

from . import multigpu  # noqa: F401  (enters the *_multigpu entries in the table)
from . import opdocs
from .opspec import SPECS

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_generated.py")
_WIDTH = 99


def _role(role):
    """The line that makes a buffer argument's Buffer(s) (:class:`~.opspec.Role`)."""
    if role.like is not None:
        return (f"{role.var} = buffers({role.param}, {role.param!r}, {role.like}.dtype, "
                f"{role.like}.count, pg._size)")
    label = "" if role.label is None else f", {role.label!r}"
    return f"{role.var} = buffer({role.param}{label})"


def _rooted(p):
    """The line that sets ``root`` to the group rank argument ``p`` (or ``group_p``) names
    (rank 0 when neither is given): the dispatcher's ``root``, one dict lookup in C for a
    global rank of the group."""
    return [f"root = pg.dispatch.root({p}, group_{p}, {p!r})"]


def _devices(spec, pad=""):
    """The check that a CUDA buffer may reach the group's backend (for ``spec.devices``)."""
    if not spec.devices:
        return []
    bufs, label = spec.devices
    return [pad + f"if {' or '.join(f'{b}.device != -1' for b in bufs)}:",
            pad + f"    check_devices(pg, ({', '.join(bufs)},), {label!r})"]


def _p2p_body(spec):
    """A point-to-point call's line: one call of ``_post`` (shared by every point-to-point
    call), which resolves the group, posts, and waits where the call blocks."""
    p = spec.peer
    rule = f"{'send' if p == 'dst' else 'recv'}_peer"
    return [f"return _post(group, {spec.kind!r}, tensor, {p}, group_{p}, tag, {rule}, "
            f"{spec.blocking})"]


def plan_name(spec):
    """The generated module's name for ``spec``'s plan."""
    return f"_plan_{spec.name}"


def one_call(spec):
    """Whether ``spec``'s entry has a path that is one backend call (``pg.dispatch.call``,
    or ``_post`` for a point-to-point call); the others are one call of ``_in_group``."""
    return spec.fast is not False or spec.peer is not None


def in_place(spec):
    """Whether ``spec``'s free function resolves the group itself (a collective with a
    one-call path: no frame before the dispatcher); else the one function it calls does,
    by the same rule (``_in_group``, or ``_post`` for a point-to-point call)."""
    return spec.peer is None and spec.fast is not False


def body(spec):
    """The lines of ``spec``'s body: on the group ``pg`` its free function resolved, or,
    for an entry without a one-call path, the call of its plan on the group ``group``
    names (``_in_group``: the plan resolves its buffers and root)."""
    if spec.peer is not None:
        return _p2p_body(spec)
    if not one_call(spec):
        if spec.roles or spec.root or spec.timeout:
            raise ValueError(f"{spec.name}: an entry without a one-call path names no roles, "
                             f"root or timeout (its plan resolves them)")
        return [f"return _in_group(group, {plan_name(spec)}, {spec.plan_args})"]
    lines = []
    if spec.timeout:
        lines.append("if timeout is not None:")
        lines.append("    timeout = timeout_seconds(timeout, 'timeout', positive=True)")
    roles = [_role(r) for r in spec.roles]
    root = _rooted(spec.root) if spec.root else ()
    lines += [*root, *roles] if spec.root_first else [*roles, *root]
    if spec.fast is not False:
        buf, root_expr, op_expr = spec.record
        call = (f"return pg.dispatch.call({spec.kind!r}, {buf}, {root_expr}, {op_expr}, "
                f"pg.backend.{spec.method}, {spec.args}, async_op, {spec.outputs}"
                f"{', timeout' if spec.timeout else ''})")
        pad = "" if spec.fast is None else "    "
        if spec.fast is not None:
            lines.append(f"if {spec.fast}:")
        lines += _devices(spec, pad)
        lines.append(pad + call)
    if spec.plan is not None:
        lines.append(f"return {plan_name(spec)}(pg, {spec.plan_args})")
    return lines


def _wrap(line):
    """``line`` (indented) broken at the commas of its first bracket into lines of at most
    ``_WIDTH`` characters, continuation lines aligned after that bracket."""
    opens = [i for i in (line.find(c) for c in "([{") if i >= 0]
    if len(line) <= _WIDTH or not opens:
        return [line]
    col = min(opens) + 1
    parts, depth, start = [], 0, col
    for i in range(col, len(line)):
        c = line[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(line[start:i + 1])
            start = i + 2  # past ", "
    parts.append(line[start:])
    out, cur = [], line[:col] + parts[0]
    for part in parts[1:]:
        if len(cur) + 1 + len(part) > _WIDTH:
            out.append(cur)
            cur = " " * col + part
        else:
            cur += " " + part
    return out + [cur]


def long_docs():
    """The names of :mod:`collectives.api.opdocs`' texts, by text."""
    return {text: name for name, text in vars(opdocs).items() if name.startswith("DOC_")}


def _doc(spec):
    """``spec.doc`` as the lines of a docstring at one indent (a long one-line text filled
    into lines of at most ``_WIDTH`` characters); for one of opdocs' texts, a comment that
    names it (the module sets it at its end)."""
    if not spec.doc:
        return []
    name = long_docs().get(spec.doc)
    if name is not None:
        return [f"    # docstring: opdocs.{name} (set at the end of the module)"]
    lines = spec.doc.strip().splitlines()
    if len(lines) == 1:
        lines = textwrap.wrap(lines[0], _WIDTH - 7, subsequent_indent="    ")
        if len(lines) == 1 and len(lines[0]) <= _WIDTH - 10:
            return [f'    """{lines[0]}"""']
        return [f'    """{lines[0]}', *lines[1:-1], f'{lines[-1]}"""']
    return [f'    """{lines[0]}', *[ln.rstrip() for ln in lines[1:]], '    """']


def source(spec):
    """The text of ``spec``'s free function: the group resolved in place (``pg``; on a
    rank outside it, what ``_absent`` says), then the body; where :func:`in_place` is
    false, the body alone (the one function it calls resolves the group)."""
    lines = ["    " + s for s in body(spec)]
    if not in_place(spec):
        out = [f"def {spec.name}({spec.params}):", *_doc(spec), *lines]
        return "\n".join(w for ln in out for w in _wrap(ln))
    absent = "        return _absent(group)"
    resolve = ["    if (pg := world.default if group is None else current(group)) is None:", absent]
    if spec.timeout:  # the timeout is checked before a non-member returns (torch's order)
        resolve = ["    pg = world.default if group is None else current(group)", *lines[:2],
                   "    if pg is None:", absent]
        free = lines[2:]
    else:
        free = lines
    out = [f"def {spec.name}({spec.params}):", *_doc(spec), *resolve, *free]
    return "\n".join(w for ln in out for w in _wrap(ln))


_HEADER = '''"""The public collectives and point-to-point calls.

GENERATED by ``python -m collectives.api.gen`` from the op table
(:data:`collectives.api.opspec.SPECS`): edit the table, not this file, and regenerate
(``tests/api/test_opspec.py`` fails when the two part). ``NAME`` is the function users
call (``collectives.NAME``), and the one the ProcessGroup methods call with ``group=``;
the long docstrings are :mod:`collectives.api.opdocs`' texts, set at the end.
"""
from . import multigpu as _multigpu
from .opspec import SPECS as _SPECS, _absent, _in_group, _post, recv_peer, send_peer
from ..core.dtypes import SUM as _SUM_CODE
from ..core.convert import {convert}
from ..core.tensors import disjoint_gather
from ..core.reduce_op import ReduceOp
from ..core.work import timeout_seconds
from ..core.world import current, world
'''


def _plan_imports():
    """The imports of the table's plans under :func:`plan_name`'s names."""
    own, other = [], []
    for spec in SPECS.values():
        if spec.plan is None:
            continue
        mod = spec.plan.__module__
        if mod == "collectives.api.opspec":
            own.append(f"{spec.plan.__name__} as {plan_name(spec)}")
        elif mod == "collectives.api.multigpu":
            other.append(f"{plan_name(spec)} = _multigpu.{spec.plan.__name__}")
        else:
            raise ValueError(f"{spec.name}: a plan of {mod} (the generator imports opspec's "
                             f"and multigpu's)")
    return [*_wrap("from .opspec import (" + ", ".join(own) + ")"), "", *other]


def module_text():
    """The text of :mod:`collectives.api._generated` for the table as it is."""
    lists = any(r.like is not None for spec in SPECS.values() if one_call(spec) for r in spec.roles)
    convert = "buffer, buffers, check_devices" if lists else "buffer, check_devices"
    parts = [_HEADER.format(convert=convert).rstrip("\n"), *_plan_imports(), "",
             "_SUM = ReduceOp.SUM", ""]
    for spec in SPECS.values():
        parts += ["", source(spec), ""]
    docs = long_docs()
    named = ", ".join(spec.name for spec in SPECS.values() if spec.doc in docs)
    parts += ["", "# the long docstrings: one copy of each, opdocs' texts, which the entries hold",
              *_wrap(f"for _fn in ({named}):"), "    _fn.__doc__ = _SPECS[_fn.__name__].doc",
              "del _fn", ""]
    names = ", ".join(repr(n) for n in SPECS)
    parts += [*_wrap(f"__all__ = [{names}]"), ""]
    return "\n".join(parts)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    text = module_text()
    with open(PATH) as f:
        old = f.read()
    if "--check" in argv:
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), text.splitlines(True), PATH, "regenerated"))
            return 1
        return 0
    if old != text:
        with open(PATH, "w") as f:
            f.write(text)
        print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
