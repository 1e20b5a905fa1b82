"""`python -m jaxrlvr.plan --config=... --mesh=1,8,1 [--xla]`: the memory plan of a run (report.py says what it prints)."""
from jaxrlvr.plan import report

if __name__ == "__main__":
  report.cli()
