"""``python -m collectives.run`` and the ``collectives-run`` console script: the launcher
(:mod:`collectives.launcher`), under the name it has always had."""
from .launcher import Config, Launcher, build_parser, free_port, main
from .launcher.ports import _bindable, _ephemeral_low

__all__ = ["main", "Config", "Launcher", "build_parser", "free_port", "_bindable", "_ephemeral_low"]

if __name__ == "__main__":
    main()
