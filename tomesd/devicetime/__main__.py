"""`python -m tomesd.devicetime fit`: fit the device-time model on docs/gpu/'s profiles and validate it;
`python -m tomesd.devicetime picks`: each model's GPU setting by predicted device time (picks.py)."""
import argparse
import sys

from .fit import main

parser = argparse.ArgumentParser(prog="python -m tomesd.devicetime", description=__doc__)
parser.add_argument("command", choices=["fit", "picks"])
parser.add_argument("--profiles", default="docs/gpu", help="the folder of recorded GPU runs (default: docs/gpu)")
parser.add_argument("--report", default="docs/device-model", help="report path without extension (.json, .md)")
args = parser.parse_args()
if args.command == "picks":
    from .picks import main as picks

    sys.exit(picks())
sys.exit(main(args.profiles, report=args.report))
