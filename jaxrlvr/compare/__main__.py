"""`python -m jaxrlvr.compare --preset=... --outdir=DIR`: the method comparison (runner.py says what it does)."""
from jaxrlvr.compare import runner

if __name__ == "__main__":
  runner.cli()
