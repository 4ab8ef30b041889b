"""``python -m collectives.config``: print or check the generated configuration page."""
import os
import sys

from . import SETTINGS, get, markdown


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m collectives.config",
                                description="The COLLECTIVES_* settings registry.")
    p.add_argument("--markdown", action="store_true", help="print the reference page (Markdown)")
    p.add_argument("-o", "--output", help="write the page to this file instead of stdout")
    p.add_argument("--check", metavar="FILE",
                   help="exit 1 if FILE differs from the generated page (for CI)")
    args = p.parse_args(argv)
    page = markdown()
    if args.check:
        try:
            with open(args.check, encoding="utf-8") as f:
                current = f.read()
        except OSError as e:
            print(f"{args.check}: {e}", file=sys.stderr)
            return 1
        if current != page:
            print(f"{args.check} is out of date: run python -m collectives.config --markdown "
                  f"-o {args.check}", file=sys.stderr)
            return 1
        return 0
    if args.markdown and args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
        return 0
    if args.markdown:
        sys.stdout.write(page)
        return 0
    for s in SETTINGS:
        where = "set" if os.environ.get(s.name, "").strip() else "default"
        print(f"{s.name:34} {get(s.name)!r} ({where})")
    return 0



if __name__ == "__main__":
    sys.exit(main())
