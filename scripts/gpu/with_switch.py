"""Run a module with the interpreter's GIL switch interval set, and/or class attributes set (a
diagnostic: whether a benchmark's threads wait on each other's GIL hand-overs; an A/B of an
engine choice in one call). The engine never sets the switch interval.

    python3 scripts/gpu/with_switch.py [--set MODULE:CLASS.ATTR=JSON]... SECONDS|- MODULE [ARGS...]

e.g. ``--set engine.core.engine_core:EngineCore.grammar_job_after_launch=false - bench.structured ...``
"""
import importlib
import json
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
args = sys.argv[1:]
while args and args[0] == "--set":
    target, _, value = args[1].partition("=")
    module, _, attr = target.partition(":")
    cls, _, name = attr.rpartition(".")
    owner = getattr(importlib.import_module(module), cls)
    if not hasattr(owner, name):
        raise SystemExit(f"{module}:{cls} has no attribute {name!r}")
    setattr(owner, name, json.loads(value))
    args = args[2:]
if args[0] != "-":
    sys.setswitchinterval(float(args[0]))
module = args[1]
sys.argv = [module] + args[2:]
runpy.run_module(module, run_name="__main__")
