from datetime import timedelta
from typing import Mapping, Optional, Tuple, Union

from .store import Store

RANK_SOURCES: Tuple[Tuple[str, str, str], ...]
LOCAL_SOURCES: Tuple[Tuple[str, str], ...]

def env_rank_world(environ: Optional[Mapping[str, str]] = ...) -> Tuple[Optional[int], Optional[int]]: ...
def env_local_rank(environ: Optional[Mapping[str, str]] = ...) -> Tuple[Optional[int], Optional[int]]: ...
def rendezvous(init_method: Optional[str] = ..., rank: int = ..., world_size: int = ...,
               timeout: Union[timedelta, float, int] = ..., store: Optional[Store] = ...,
               environ: Optional[Mapping[str, str]] = ...) -> Tuple[Store, int, int]: ...
