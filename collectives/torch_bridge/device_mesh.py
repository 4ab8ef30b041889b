"""DeviceMesh and init_device_mesh, as torch.distributed.device_mesh.

A mesh lays the ranks out in an n-dimensional array and gives every dimension a
process group: the ranks that differ only in that coordinate. A 2-D mesh of 4 ranks,
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``, is
``[[0, 1], [2, 3]]``: rank 1's "tp" group is ranks 0 and 1, its "dp" group ranks 1 and 3.

Every rank of the default group makes every mesh (SPMD), in the same order: the groups
are made with ``split_group`` over the default group. ``mesh.mesh`` is a torch tensor
where the program has imported torch, a NumPy array otherwise.

Example:
    >>> mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> dist.all_reduce(grad, group=mesh.get_group("dp"))
    >>> tp = mesh["tp"]; tp.get_local_rank()
"""
import os
import sys

import numpy as np

from ..api import group as _g

__all__ = ["DeviceMesh", "init_device_mesh"]


class MeshDimError(KeyError, ValueError):
    """A mesh dimension named that the mesh does not have (a KeyError, as torch raises,
    and a ValueError, as misuse raises here)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


def _check_device_type(device_type):
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a string such as 'cpu' or 'cuda', "
                        f"got {type(device_type).__name__}")
    if not device_type.isalpha():
        raise ValueError(f"device_type must be a device type without an index, such as 'cpu' "
                         f"or 'cuda', got {device_type!r} (pass device.type for a torch.device)")
    return device_type


def _rank_array(mesh):
    """``mesh`` (torch tensor, array, nested lists) as a NumPy int64 array of distinct ranks."""
    if mesh is None:
        raise TypeError("mesh must be given: an array of global ranks, e.g. [[0, 1], [2, 3]]")
    if hasattr(mesh, "detach") and hasattr(mesh, "tolist"):  # a torch tensor (any device)
        mesh = mesh.detach().cpu().tolist()
    try:
        arr = np.asarray(mesh)
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"mesh must be a rectangular array of ranks: {e}") from None
    if arr.ndim == 0 or arr.size == 0:
        raise ValueError(f"mesh must be a non-empty array of ranks with at least one "
                         f"dimension, got {mesh!r}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"mesh must hold int ranks, got an array of {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.min() < 0:
        raise ValueError(f"mesh must hold global ranks (>= 0), got {int(arr.min())}")
    flat = arr.ravel().tolist()
    if len(set(flat)) != len(flat):
        dup = next(r for r in flat if flat.count(r) > 1)
        raise ValueError(f"mesh must name each rank once, got rank {dup} more than once")
    return arr


def _check_names(names, ndim):
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(f"mesh_dim_names must be a tuple of strings, got the string {names!r}")
    names = tuple(names)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"mesh_dim_names must hold strings, got {type(n).__name__}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names must be unique, got {names}")
    if len(names) != ndim:
        raise ValueError(f"mesh_dim_names must name each of the mesh's {ndim} dimensions, "
                         f"got {len(names)}: {names}")
    return names


def _one_override(value, where):
    """(backend name or None, options or None) from str, (str, options) or options."""
    if value is None or isinstance(value, str):
        return value, None
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[0], str):
            raise ValueError(f"backend_override[{where!r}] must be a backend name, options, or "
                             f"(name, options), got {value!r}")
        return value
    return None, value


def _normalize_override(override, ndim, names):
    """A tuple of ndim (backend, options) pairs from init_device_mesh's dict form."""
    if override is None:
        return None
    if not isinstance(override, dict):
        raise TypeError(f"backend_override must be a dict of mesh dimension (index or name) "
                        f"to backend, got {type(override).__name__}")
    out = [(None, None)] * ndim
    seen = set()
    for key, value in override.items():
        if isinstance(key, str):
            if not names or key not in names:
                raise MeshDimError(f"backend_override: mesh dimension {key!r} does not exist "
                                   f"(mesh_dim_names={names})")
            dim = names.index(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            dim = key + ndim if key < 0 else key
            if not 0 <= dim < ndim:
                raise ValueError(f"backend_override: mesh dimension {key} is out of range for "
                                 f"a {ndim}-dimensional mesh")
        else:
            raise TypeError(f"backend_override keys must be dimension indices or names, "
                            f"got {type(key).__name__}")
        if dim in seen:
            raise ValueError(f"backend_override names mesh dimension {dim} twice")
        seen.add(dim)
        out[dim] = _one_override(value, key)
    return tuple(out)


def _setup_world(device_type):
    """Initialise the default group if needed (env://, the device's default backend), and
    pick this process's CUDA device as torch does when the program has not."""
    if not _g.is_initialized():
        backend = _g._DEVICE_BACKEND.get(device_type)
        _g.init_process_group(backend)
    torch = sys.modules.get("torch")
    if device_type == "cuda" and torch is not None and torch.cuda.is_available() \
            and not torch.cuda.is_initialized():
        local = os.environ.get("LOCAL_RANK")
        count = torch.cuda.device_count()
        torch.cuda.set_device(int(local) if local is not None else _g.get_rank() % count)


class DeviceMesh:
    """An n-dimensional layout of global ranks with one process group per dimension.

    Args:
        device_type: 'cpu', 'cuda', ... (no device index).
        mesh: the global ranks, an n-dimensional array (torch tensor, NumPy array or
            nested lists) naming each rank at most once.
        mesh_dim_names: a unique name for each dimension (needed for ``mesh["name"]``).
        backend_override: one (backend, options) pair per dimension, (None, None) for the
            default group's backend.

    Every rank of the default group constructs the mesh, ranks outside it included
    (they get ``get_coordinate() is None`` and no groups).
    """

    def __init__(self, device_type, mesh, *, mesh_dim_names=None, backend_override=None,
                 _init_backend=True):
        self._device_type = _check_device_type(device_type)
        self._ranks = _rank_array(mesh)
        self._names = _check_names(mesh_dim_names, self._ranks.ndim)
        ndim = self._ranks.ndim
        if backend_override is not None:
            backend_override = tuple(backend_override)
            if len(backend_override) != ndim:
                raise ValueError(f"backend_override must hold one entry per mesh dimension "
                                 f"({ndim}), got {len(backend_override)}")
            backend_override = tuple(_one_override(v, i) for i, v in enumerate(backend_override))
        self._root = self
        self._dims = tuple(range(ndim))  # this mesh's dimensions in the root mesh's
        self._flat = {}                   # the root's flattened meshes by name
        self._groups = None
        if _init_backend:
            _setup_world(self._device_type)
            world = _g.get_world_size()
            if int(self._ranks.max()) >= world:
                raise ValueError(f"mesh must hold global ranks in [0, {world}) (the default "
                                 f"group's size), got {int(self._ranks.max())}")
            overrides = backend_override or ((None, None),) * ndim
            self._groups = [self._dim_group(d, *overrides[d]) for d in range(ndim)]
        self._coordinate = self._find_coordinate()

    # ---- construction helpers ------------------------------------------------------------

    def _find_coordinate(self):
        if not _g.is_initialized():
            return None
        hit = np.argwhere(self._ranks == _g.get_rank())
        return tuple(int(i) for i in hit[0]) if len(hit) else None

    def _dim_group(self, dim, backend, options):
        """This rank's group along ``dim`` (every rank of the world takes part)."""
        slices = np.moveaxis(self._ranks, dim, -1).reshape(-1, self._ranks.shape[dim]).tolist()
        return _split(slices, backend, options)

    def _derived(self, ranks, names, groups, dims):
        """A mesh sharing this one's root and process groups (no new groups)."""
        sub = DeviceMesh(self._device_type, ranks, mesh_dim_names=names, _init_backend=False)
        sub._groups = groups
        sub._root = self._root
        sub._dims = dims
        return sub

    @staticmethod
    def from_group(group, device_type, mesh=None, *, mesh_dim_names=None):
        """A mesh over existing groups: one group gives a 1-D mesh of its ranks; a list
        of groups needs ``mesh`` (one dimension per group) and ``mesh_dim_names``."""
        if isinstance(group, _g.ProcessGroup):
            ranks = _g.get_process_group_ranks(group)
            if mesh is not None and _rank_array(mesh).tolist() != ranks:
                raise ValueError(f"mesh {mesh!r} does not match the group's ranks {ranks}")
            dm = DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _init_backend=False)
            dm._groups = [group]
            return dm
        if not isinstance(group, (list, tuple)):
            raise TypeError(f"group must be a ProcessGroup or a list of them, "
                            f"got {type(group).__name__}")
        groups = list(group)
        if not groups:
            raise ValueError("group must hold at least one ProcessGroup")
        if mesh is None:
            raise ValueError("mesh must be given with a list of groups")
        if mesh_dim_names is None:
            raise ValueError("mesh_dim_names must be given with a list of groups")
        dm = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=False)
        if dm.ndim != len(groups):
            raise ValueError(f"mesh has {dm.ndim} dimensions but {len(groups)} groups were given")
        dm._groups = groups
        return dm

    # ---- queries ---------------------------------------------------------------------------

    @property
    def device_type(self):
        return self._device_type

    @property
    def mesh(self):
        """The global ranks: a torch int tensor where torch is imported, else a NumPy array."""
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "tensor"):
            return torch.tensor(self._ranks.tolist(), dtype=torch.int)
        return self._ranks.copy()

    @property
    def mesh_dim_names(self):
        return self._names

    @property
    def ndim(self):
        return self._ranks.ndim

    @property
    def shape(self):
        return tuple(self._ranks.shape)

    def size(self, mesh_dim=None):
        """Ranks in the mesh, or along ``mesh_dim`` (index or name)."""
        if mesh_dim is None:
            return int(self._ranks.size)
        return int(self._ranks.shape[self._dim(mesh_dim)])

    def get_rank(self):
        """This process's global rank."""
        return _g.get_rank()

    def get_coordinate(self):
        """This rank's index along every dimension, or None if it is not in the mesh."""
        return self._coordinate

    def _dim(self, mesh_dim, name="mesh_dim"):
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"{name} must be given for a {self.ndim}-dimensional mesh "
                                 f"(get_all_groups() gives every dimension's group)")
            return 0
        if isinstance(mesh_dim, str):
            if not self._names or mesh_dim not in self._names:
                raise MeshDimError(f"mesh dimension {mesh_dim!r} does not exist; the mesh's "
                                   f"mesh_dim_names are {self._names}")
            return self._names.index(mesh_dim)
        if not isinstance(mesh_dim, int) or isinstance(mesh_dim, bool):
            raise TypeError(f"{name} must be a dimension index or name, got {type(mesh_dim).__name__}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"{name} must be in [0, {self.ndim}) for this mesh, got {mesh_dim}")
        return mesh_dim % self.ndim

    def get_group(self, mesh_dim=None):
        """The process group of dimension ``mesh_dim`` (index or name; may be left out on a
        1-D mesh); ``GroupMember.NON_GROUP_MEMBER`` on a rank outside the mesh."""
        if self._groups is None:
            raise ValueError("this DeviceMesh was made with _init_backend=False and has no groups")
        return self._groups[self._dim(mesh_dim)]

    def get_all_groups(self):
        return [self.get_group(i) for i in range(self.ndim)]

    def get_local_rank(self, mesh_dim=None):
        """This rank's rank in the group of ``mesh_dim`` (-1 outside the mesh)."""
        return _g.get_rank(self.get_group(mesh_dim))

    # ---- slicing and flattening ------------------------------------------------------------

    def __getitem__(self, mesh_dim_names):
        """The sub-mesh of the named dimensions that holds this rank, in the order named;
        or a dimension made by ``_flatten`` on the root mesh."""
        if not self._names:
            raise ValueError("a DeviceMesh without mesh_dim_names cannot be sliced")
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if names == self._names:
            return self
        if len(names) == 1 and names[0] not in self._names and names[0] in self._root._flat:
            return self._root._flat[names[0]]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"mesh_dim_names must name distinct dimensions, got {names}")
        picked = [self._dim(n, "mesh_dim_names") for n in names]
        coord = self._coordinate or (0,) * self.ndim
        index = tuple(slice(None) if d in picked else coord[d] for d in range(self.ndim))
        kept = sorted(picked)
        ranks = np.transpose(self._ranks[index], [kept.index(d) for d in picked])
        groups = None if self._groups is None else [self._groups[d] for d in picked]
        return self._derived(ranks, names, groups, tuple(self._dims[d] for d in picked))

    def _flatten(self, mesh_dim_name=None, backend_override=None):
        """A 1-D mesh of this (sub-)mesh's ranks, with a new group for it on every slice of
        the root mesh; the root then answers ``root[mesh_dim_name]`` with it. Every rank calls
        it, as torch's."""
        if not self._names:
            raise ValueError("a DeviceMesh without mesh_dim_names cannot be flattened")
        name = mesh_dim_name or "_".join(self._names)
        if not isinstance(name, str):
            raise TypeError(f"mesh_dim_name must be a string, got {type(name).__name__}")
        if self.ndim == 1 and name in self._names:
            return self
        root = self._root
        if self._dims is None:
            raise ValueError("a flattened mesh cannot be flattened again")
        known = root._flat.get(name)
        if known is not None:
            if known._flat_from != self._dims:
                raise ValueError(f"mesh_dim_name {name!r} already names a flattening of other "
                                 f"dimensions")
            return known
        if root._names and name in root._names:
            raise ValueError(f"mesh_dim_name {name!r} is already a dimension of the root mesh")
        backend, options = _one_override(backend_override, name)
        rest = [d for d in range(root.ndim) if d not in self._dims]
        slices = np.transpose(root._ranks, rest + list(self._dims)).reshape(-1, self.size())
        flat = self._derived(self._ranks.ravel(), (name,), None, None)
        flat._groups = [_split(slices.tolist(), backend, options)]
        flat._flat_from = self._dims
        root._flat[name] = flat
        return flat

    # ---- identity ----------------------------------------------------------------------------

    def _key(self):
        return (self._device_type, self.shape, tuple(self._ranks.ravel().tolist()), self._names)

    def __eq__(self, other):
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        names = f", mesh_dim_names={self._names}" if self._names else ""
        return f"DeviceMesh({self._device_type!r}, {self._ranks.tolist()}{names})"

    def __enter__(self):
        _current.append(self)
        return self

    def __exit__(self, *exc):
        _current.pop()


_current = []  # meshes entered with ``with mesh:`` (torch keeps the same stack)


def _split(slices, backend, options):
    """This rank's group among ``slices`` (lists of global ranks), made on every rank of
    the world: the default group itself where one slice is the whole world in order."""
    world = _g.default_group()
    if len(slices) == 1 and slices[0] == list(range(world.size())) and backend is None \
            and options is None:
        return world
    pg = _g.split_group(None, split_ranks=slices, backend=backend, pg_options=options)
    return _g.GroupMember.NON_GROUP_MEMBER if pg is None else pg


def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None, backend_override=None):
    """A DeviceMesh of ranks 0 .. prod(mesh_shape)-1 in row-major order, initialising the
    default group (env://) first if the program has not.

    Args:
        device_type: 'cpu', 'cuda', ... (no device index).
        mesh_shape: the mesh's size along each dimension; its product may not exceed the
            world size.
        mesh_dim_names: a unique name per dimension.
        backend_override: {dimension index or name: backend name, options, or (name,
            options)} for the groups of those dimensions.

    Example:
        >>> mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    """
    _check_device_type(device_type)
    if isinstance(mesh_shape, int) and not isinstance(mesh_shape, bool):
        mesh_shape = (mesh_shape,)
    if not isinstance(mesh_shape, (tuple, list)) or not mesh_shape:
        raise TypeError(f"mesh_shape must be a non-empty tuple of ints, got {mesh_shape!r}")
    for s in mesh_shape:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"mesh_shape must hold positive ints, got {tuple(mesh_shape)}")
    names = _check_names(mesh_dim_names, len(mesh_shape))
    override = _normalize_override(backend_override, len(mesh_shape), names)
    total = int(np.prod(mesh_shape))
    _setup_world(device_type)
    world = _g.get_world_size()
    if total > world:
        raise ValueError(f"mesh_shape {tuple(mesh_shape)} needs {total} ranks; the default "
                         f"group has {world}")
    ranks = np.arange(total, dtype=np.int64).reshape(mesh_shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=names, backend_override=override)
