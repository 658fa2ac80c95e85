"""``python -m trec_pipelines.advise``: see :mod:`trec_pipelines.advise.cli`."""

from trec_pipelines.advise.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
