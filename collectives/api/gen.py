"""The generator of :mod:`collectives.api._generated`: the public collectives and their
bodies on a resolved group, written out from the op table (:data:`collectives.api.opspec.SPECS`).

Run ``python -m collectives.api.gen`` after changing an entry of the table (or
``--check``: exit status 1, and the difference, when the checked-in module is not what the
table makes; ``tests/api/test_opspec.py`` runs the check). The generator imports the
package, so the module it replaces must still import: to add a collective, enter its
OpSpec, regenerate, then export the new function.

From each OpSpec two functions are written: the free function (``all_reduce``: resolve
the group, then the body) and ``all_reduce_run(pg, ...)`` (the body on a group already
resolved), which the ProcessGroup methods call (:data:`RUNS`). The body is the same text in
both, written in place rather than called, so the free function's common call
(``dist.all_reduce(t)``) has one Python frame and goes straight to the group's dispatcher
(``pg.dispatch.call``: :mod:`collectives.api.dispatch`).
"""
import difflib
import os
import sys
import textwrap

from . import multigpu  # noqa: F401  (enters the *_multigpu entries in the table)
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


def _rooted(p, var="root", rule=None, more=""):
    """The lines that set ``var`` to the group rank argument ``p`` (or ``group_p``) names:
    the global rank's common case is one dict lookup; else (or where ``more`` holds) the
    ``rule`` in full (default: the root's, rank 0 when neither is given)."""
    rule = rule or f"pg.peer({p}, group_{p}, {p!r}, default=0)"
    return [f"{var} = pg.group_of_global.get({p}) if type({p}) is int and group_{p} is None "
            f"else None",
            f"if {var} is None{more}:",
            f"    {var} = {rule}"]


def _devices(spec, pad=""):
    """The check that a CUDA buffer may reach the group's backend (for ``spec.devices``)."""
    if not spec.devices:
        return []
    bufs, label = spec.devices
    return [pad + f"if {' or '.join(f'{b}.device != -1' for b in bufs)}:",
            pad + f"    check_devices(pg, ({', '.join(bufs)},), {label!r})"]


def _p2p_body(spec):
    """A point-to-point call's lines: its peer, its tag, its buffer, then the post."""
    p = spec.peer
    rule = f"{'send' if p == 'dst' else 'recv'}_peer(pg, {p}, group_{p})"
    buf, peer, tag = spec.record
    lines = [*_rooted(p, "peer", rule, " or peer == pg._rank"),
             "if type(tag) is not int or not 0 <= tag < TAG_LIMIT:",
             "    check_tag(tag)",  # (the rule; the test above only spares the call)
             *[_role(r) for r in spec.roles], *_devices(spec),
             f"req = pg.dispatch.post({spec.kind!r}, pg.backend.{spec.method}, {buf}, {peer}, "
             f"{tag})"]
    if spec.blocking:
        lines.append("req.wait()")
    return lines + list(spec.result)


def plan_name(spec):
    """The generated module's name for ``spec``'s plan."""
    return f"_plan_{spec.name}"


def body(spec):
    """The lines of ``spec``'s body, on a group ``pg`` already resolved."""
    if spec.peer is not None:
        return _p2p_body(spec)
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


def params(spec, group):
    """The parameters of ``spec``'s free function (``group``) or of its run (without)."""
    ps = [p.strip() for p in spec.params.split(",")]
    return ", ".join(ps if group else ["pg"] + [p for p in ps if not p.startswith("group=")])


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


def _doc(spec):
    """``spec.doc`` as the lines of a docstring at one indent (a long one-line text filled
    into lines of at most ``_WIDTH`` characters)."""
    if not spec.doc:
        return []
    lines = spec.doc.strip().splitlines()
    if len(lines) == 1:
        lines = textwrap.wrap(lines[0], _WIDTH - 7, subsequent_indent="    ")
        if len(lines) == 1 and len(lines[0]) <= _WIDTH - 10:
            return [f'    """{lines[0]}"""']
        return [f'    """{lines[0]}', *lines[1:-1], f'{lines[-1]}"""']
    return [f'    """{lines[0]}', *[ln.rstrip() for ln in lines[1:]], '    """']


def source(spec):
    """The text of ``spec``'s free function and of its run function."""
    lines = ["    " + s for s in body(spec)]
    resolve = ["    pg = world.default if group is None else current(group)",
               "    if pg is None:",
               f"        return _absent(group{'' if spec.absent == 'None' else ', ' + spec.absent})"]
    if spec.timeout:  # the timeout is checked before a non-member returns (torch's order)
        resolve = resolve[:1] + lines[:2] + resolve[1:]
        free = lines[2:]
    else:
        free = lines
    out = [f"def {spec.name}({params(spec, True)}):", *_doc(spec), *resolve, *free, "",
           "", f"def {spec.name}_run({params(spec, False)}):",
           f'    """``{spec.name}``\'s body on the group ``pg``."""', *lines]
    return "\n".join(w for ln in out for w in _wrap(ln))


_HEADER = '''"""The public collectives and point-to-point calls, and their bodies on a resolved group.

GENERATED by ``python -m collectives.api.gen`` from the op table
(:data:`collectives.api.opspec.SPECS`): edit the table, not this file, and regenerate
(``tests/api/test_opspec.py`` fails when the two part). ``NAME`` is the function users
call (``collectives.NAME``); ``NAME_run(pg, ...)`` is its body on a group already
resolved, which the ProcessGroup methods run (:data:`RUNS`).
"""
from . import multigpu as _multigpu
from .opspec import _absent, any_sender, recv_peer, send_peer
from ..core.args import TAG_LIMIT, check_tag
from ..core.dtypes import SUM as _SUM_CODE
from ..core.convert import buffer, buffers, check_devices
from ..core.tensors import disjoint_gather
from ..core.reduce_op import ReduceOp
from ..core.work import Work, timeout_seconds
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
    parts = [_HEADER.rstrip("\n"), *_plan_imports(), "", "_SUM = ReduceOp.SUM", ""]
    for spec in SPECS.values():
        parts += ["", source(spec), ""]
    runs = ", ".join(f"{name!r}: {name}_run" for name in SPECS)
    parts += ["", "#: the body of each entry on a resolved group, by the entry's name",
              *_wrap(f"RUNS = {{{runs}}}"), ""]
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
