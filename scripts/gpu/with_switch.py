"""Run a module with the interpreter's GIL switch interval set (a diagnostic: whether a
benchmark's threads wait on each other's GIL hand-overs). The engine never sets it.

    python3 scripts/gpu/with_switch.py SECONDS MODULE [ARGS...]
"""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
sys.setswitchinterval(float(sys.argv[1]))
module = sys.argv[2]
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__")
